"""The benchmark starts every documented way: as a module, as a file from any directory, and as the
Bazel binary (its runfiles launcher, when running under Bazel)."""

import os
import subprocess
import sys

import pytest
import torch

from critic_adapters.common.tests.helpers import run_pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/


def _run(command, cwd, **env):
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment.update(env)
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=environment, timeout=300)


def test_runs_as_a_file_from_another_directory(tmp_path):
    # `python bench/critic_update.py` once failed with ModuleNotFoundError: common.
    result = _run([sys.executable, os.path.join(HERE, "critic_update.py"), "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--repeats" in result.stdout


MODULES = {"critic_update": "--repeats", "long_context": "--lengths", "dp_shares": "--short", "offload": "--backends",
           "scale": "--sweep-tokens", "rank_memory": "--ranks", "value_learning": "--losses", "gae_speed": "--shapes",
           "multi_turn": "--variants", "optimizers": "--skip-jobs", "vision": "--backends", "serve": "--concurrency",
           "memory_plan": "--device-memory"}
# `python -m critic_adapters.bench.MODULE --help` for every module, in one interpreter started from another
# directory with only the package's parent on its path (runpy runs each as `-m` does): one start-up, not 13.
HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
answers = {}
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out, code = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("critic_adapters.bench." + module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = exit_.code
    answers[module] = [code, out.getvalue()]
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_of_each(tmp_path_factory):
    import json

    result = _run([sys.executable, "-c", HELP_OF_EACH, *MODULES], cwd=tmp_path_factory.mktemp("elsewhere"),
                  PYTHONPATH=os.path.dirname(HERE))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_runs_as_a_module(help_of_each, module):
    import ast

    code, stdout = help_of_each[module]
    assert code in (0, None), stdout[-2000:]
    assert MODULES[module] in stdout
    # The description is the docstring's whole first paragraph, not its first line cut mid-sentence.
    with open(os.path.join(HERE, f"{module}.py")) as f:
        summary = ast.get_docstring(ast.parse(f.read())).split("\n\n")[0]
    assert " ".join(summary.split()) in " ".join(stdout.split()), stdout


def test_the_offload_benchmark_moves_the_state_and_brings_it_back(tmp_path):
    """bench/offload.py on a tiny critic: every byte off the device and back, values equal after."""
    import json

    out = tmp_path / "offload.json"
    result = _run([sys.executable, "-m", "critic_adapters.bench.offload", "--repeats", "1", "--hidden", "64",
                   "--layers", "2", "--backends", "fsdp,megatron", "--out", str(out)], cwd=tmp_path,
                  PYTHONPATH=os.path.dirname(HERE))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("offload+onload s/GiB: fsdp ")
    rows = json.loads(out.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["fsdp", "megatron"]
    assert all(r["bytes"] > 0 and r["resident_bytes_after"] == 0 and r["values_equal_after"] for r in rows), rows
    # CUDA's allocated / reserved / free bytes around the offload (issue 41, item 7); none on CPU.
    cuda = torch.cuda.is_available()
    assert all((r["device_memory_after_offload"] is not None) == cuda for r in rows), rows


def test_the_long_context_benchmark_reports_what_torch_saves_for_backward(tmp_path):
    """bench/long_context.py at 512 tokens on fsdp (about 20 s): beside the resident-set ratio, the
    bytes saved for backward per rank, positive, about halved by the split (each rank saves half of
    every activation), printed per pair and in the last line."""
    import json

    out = tmp_path / "long_context.json"
    result = _run([sys.executable, "-m", "critic_adapters.bench.long_context", "--lengths", "512", "--backends",
                   "fsdp", "--out", str(out)], cwd=tmp_path, PYTHONPATH=os.path.dirname(HERE))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    unsplit, split = row["unsplit"], row["split"]
    assert unsplit["saved_mib_per_rank"] > 0 and split["saved_mib_per_rank"] > 0, row
    assert 0.45 < row["saved_ratio"] < 0.55, row
    # The parameter and optimizer bytes of the two ranks sum to the unsplit rank's (step counters aside).
    assert split["all_ranks"]["parameters"] == unsplit["all_ranks"]["parameters"] > 0, row
    assert (split["max_per_rank"]["device_peak_added"] is not None) == torch.cuda.is_available(), row
    pair = [line.split() for line in result.stdout.splitlines() if "memory ratio" in line]
    assert pair == [["fsdp", "512", "tokens:", "memory", "ratio", f"{row['memory_ratio']:.2f}", "(resident),",
                     f"{row['saved_ratio']:.2f}", "(saved", "for", "backward)"]], result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert f"saved for backward: fsdp {row['saved_ratio']:.2f}; speed vs 1: " in last, last


def test_the_optimizer_benchmark_counts_each_options_state(tmp_path):
    """bench/optimizers.py on a tiny critic at 2 ranks: bf16 moments hold half of fp32 AdamW's state,
    Muon one buffer on its matrices, offload_state none of it on the device between steps."""
    import json

    out = tmp_path / "optimizers.json"
    config = os.path.join(os.path.dirname(HERE), "common", "testdata", "configs", "qwen2.json")
    result = _run([sys.executable, "-m", "critic_adapters.bench.optimizers", "--config", config, "--skip-jobs",
                   "--repeats", "1", "--out", str(out)], cwd=tmp_path, PYTHONPATH=os.path.dirname(HERE))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    engines = json.loads(out.read_text())["engines"]
    adamw, bf16, muon, offload = (engines[k] for k in ("adamw", "adamw_bf16", "muon", "adamw_offload"))
    n = adamw["parameter_count"]
    assert abs(adamw["optimizer"] / n - 8.0) < 0.01 and adamw["parameters"] == adamw["gradients"] == 4 * n, adamw
    assert abs(bf16["optimizer"] / adamw["optimizer"] - 0.5) < 0.001, (bf16, adamw)  # the step counters aside
    assert 4 * n < muon["optimizer"] < adamw["optimizer"], muon
    assert offload["optimizer"] == adamw["optimizer"] and offload["optimizer_resident_between"] == 0, offload
    assert "| adamw_offload | 4.00 | 4.00 | 8.00 | 0.00 |" in result.stdout, result.stdout
    # each option's step beside a whole update of a default-job mini-batch; Muon's Newton-Schulz work
    # split among the 2 ranks (the slowest rank's share and every matrix, timed in the same run)
    assert all(r["update_s"] > r["step_s"] > 0 and r["update_tokens"] > 1000 for r in engines.values()), engines
    shares = muon["orthogonalise"]
    assert shares["matrices"] == 14 and 0 < shares["own_share_s"] and 0 < shares["every_matrix_s"], shares
    assert "muon: Newton-Schulz of 14 matrices, the slowest rank's share" in result.stdout, result.stdout
    # which bf16 step was timed: the one-pass kernel here (setup installs a C compiler)
    assert bf16["bf16_step"].startswith("one-pass C kernel") and "bf16_step" not in adamw, bf16
    assert "adamw_bf16: adamw's bf16 step: one-pass C kernel" in result.stdout, result.stdout


def test_the_scale_benchmark_measures_each_run(tmp_path):
    """bench/scale.py on a tiny mixture-of-experts config (fsdp at 1 and 2 ranks, megatron at expert
    parallel 2): every run's update, the 1-rank sweep over row lengths and tokens, and the
    per-backend last line."""
    import json

    out = tmp_path / "scale.json"
    config = os.path.join(os.path.dirname(HERE), "common", "testdata", "configs", "qwen3_moe.json")
    result = _run([sys.executable, "-m", "critic_adapters.bench.scale", "--config", config, "--backends",
                   "fsdp,megatron", "--ranks", "1,2", "--megatron-layout", "expert=2", "--tokens", "64", "--lengths",
                   "32,64", "--sweep-tokens", "32,64", "--out", str(out)], cwd=tmp_path, PYTHONPATH=os.path.dirname(HERE))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "megatron at 2 ranks: expert=2" in result.stdout
    lines = result.stdout.splitlines()
    # The sweep's table follows the whole main table (the last main row is megatron's at 2 ranks).
    assert lines.index("fsdp at 1 rank, update time by row length and by tokens per update:") > \
           max(i for i, line in enumerate(lines) if line.startswith("| megatron | 2 |")), result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("scale: megatron mfu=") and "peak/param=" in last, last
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["ranks"]) for r in rows] == [("fsdp", 1), ("fsdp", 2), ("megatron", 1), ("megatron", 2)]
    sweep = [(s["length"], s["tokens"]) for s in rows[0]["steps"]]
    assert sweep == [(32, 64), (32, 64), (64, 64), (32, 32)]  # the measured update, then the sweep
    assert len(rows[1]["steps"]) == 1 and len(rows[1]["load_peak"]) == 2
    assert all(0 < s["mfu"] < 1 and s["tokens_per_s"] > 0 for r in rows for s in r["steps"])
    # What torch holds (bench/tensor_bytes.py): parameters and Adam state at least (12 B/param), at
    # 1 rank; the activations saved for backward.
    assert all(r["held_bytes_per_param"] >= 12 for r in rows if r["ranks"] == 1), rows
    assert all(s["saved_for_backward"] > 0 for r in rows for s in r["steps"]), rows
    assert "held/param=" in last and "saved_mib=" in last, last


def test_the_scale_benchmark_names_only_the_layouts_it_runs(tmp_path):
    """fsdp at 1 rank alone: no megatron layout line; the sweep's table after the main one."""
    config = os.path.join(os.path.dirname(HERE), "common", "testdata", "configs", "qwen3_moe.json")
    result = _run([sys.executable, "-m", "critic_adapters.bench.scale", "--config", config, "--backends", "fsdp",
                   "--ranks", "1", "--tokens", "32", "--lengths", "32", "--sweep-tokens", "32"], cwd=tmp_path,
                  PYTHONPATH=os.path.dirname(HERE))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "megatron" not in result.stdout, result.stdout
    lines = result.stdout.splitlines()
    assert lines.index("fsdp at 1 rank, update time by row length and by tokens per update:") > \
           next(i for i, line in enumerate(lines) if line.startswith("| fsdp | 1 |"))


def test_bazel_binary_runs():
    if not os.environ.get("TEST_SRCDIR"):
        pytest.skip("only under bazel test: the py_binary's launcher lives in its runfiles")
    from runfiles import runfiles

    launcher = runfiles.Create().Rlocation("critic_adapters/bench/critic_update")
    result = _run([launcher, "--help"], cwd=os.environ.get("TEST_TMPDIR", "/tmp"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--repeats" in result.stdout


if __name__ == "__main__":
    run_pytest(__file__)
