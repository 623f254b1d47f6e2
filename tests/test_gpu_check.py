"""tools/gpu-check --cpu: every check of the GPU run, on a tiny critic on CPU, present in
gpu_check.json and none failed (so the script the first GPU run depends on never rots)."""

import json
import os
import subprocess
import sys

from critic_adapters.common.tests.helpers import run_pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = ("wheels", "0_env", "1_fsdp_fp32_parity", "2_fsdp_bf16", "3_megatron_fp32", "4_megatron_bf16",
          "5_offload_memory", "6_packed_attention", "7_fsdp_cpu_offload", "8_scale_bf16", "9_veomni", "10_vision",
          "11_service")


def test_the_cpu_mode_runs_every_check(tmp_path):
    out = os.environ.get("TEST_TMPDIR") or str(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the package itself
    result = subprocess.run([os.path.join(ROOT, "tools", "gpu-check"), "--cpu", "--out", out], cwd=tmp_path,
                            env=dict(env, PYTHON=sys.executable), capture_output=True, text=True, timeout=280)
    with open(os.path.join(out, "gpu_check.json")) as f:
        report = json.load(f)
    checks = report["checks"]
    assert tuple(checks) == CHECKS, list(checks)
    failed = {name: entry.get("traceback") or entry.get("error") for name, entry in checks.items()
              if entry["status"] == "failed"}
    assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())
    assert all(entry["status"] in ("ok", "skipped") for entry in checks.values()), checks
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # On CPU only the wheel install is skipped: a check skipped for lack of time would go untested.
    skipped = {name: entry["reason"] for name, entry in checks.items() if entry["status"] == "skipped"}
    assert set(skipped) <= {"wheels"}, skipped
    assert report["mode"] == "cpu" and report["elapsed_s"] < report["budget_s"]



def test_a_check_is_recorded_whatever_happens_to_it(tmp_path):
    """The harness alone: a check that passes, breaks a limit, raises, skips itself, overruns its cap,
    or no longer fits in the budget; each entry written with its numbers."""
    import time

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gpu_check

    class Skip(Exception):
        pass

    class Run:
        closed = 0

        def end_check(self):
            self.closed += 1

    def passes(run, n):
        n.at_most("diff", 0.5, 1.0)

    def breaks(run, n):
        n.at_most("diff", 2.0, 1.0)
        n.require("equal", False, "bit-equal")

    def raises(run, n):
        n["before"] = 1
        raise RuntimeError("boom")

    def skips(run, n):
        raise Skip("needs CUDA")

    def hangs(run, n):
        n["started"] = True
        time.sleep(30)

    names = ["passes", "breaks", "raises", "skips", "hangs", "late"]
    results = gpu_check.Results(str(tmp_path), {"mode": "test"}, names)
    run = Run()
    for name, check in zip(names, (passes, breaks, raises, skips, hangs, passes)):
        budget = 1e9 if name != "late" else 0.0
        gpu_check.run_check(results, name, check, run, estimate_s=0.1, cap_s=0.5, budget_s=budget, skip=Skip)
    with open(tmp_path / "gpu_check.json") as f:
        checks = json.load(f)["checks"]
    assert {name: entry["status"] for name, entry in checks.items()} == {
        "passes": "ok", "breaks": "failed", "raises": "failed", "skips": "skipped", "hangs": "failed", "late": "skipped"}
    assert checks["passes"]["numbers"] == {"diff": 0.5} and checks["passes"]["limits"] == {"diff": "<= 1"}
    assert "diff=2 (want <= 1)" in checks["breaks"]["error"] and "equal=False (bit-equal)" in checks["breaks"]["error"]
    assert checks["raises"]["error"] == "RuntimeError: boom" and "boom" in checks["raises"]["traceback"]
    assert checks["raises"]["numbers"] == {"before": 1}
    assert checks["skips"]["reason"] == "needs CUDA"
    assert checks["hangs"]["error"].startswith("stopped after 0.5 s") and checks["hangs"]["numbers"] == {"started": True}
    assert checks["late"]["reason"] == "time"
    assert run.closed == 5  # after every check that ran, whatever its end


if __name__ == "__main__":
    run_pytest(__file__)
