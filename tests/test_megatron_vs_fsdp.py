"""The megatron engine trains like the FSDP engine: one update on the same batch gives the same loss
(<= 1e-5) and grad norm (<= 1e-4 relative), and 5 steps at TP1 / TP2 / PP2 follow the FSDP
engine's loss curve (<= 1e-4)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import save_rollout_batch, run_pytest

LAYOUTS = {"tp1": (1, {}), "tp2": (2, {"tensor": 2}), "pp2": (2, {"pipeline": 2})}
STEPS = 5


def run_worker(nproc: int, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "critic_adapters.tests.update_worker", *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def make_batch(path: str) -> None:
    save_rollout_batch(path, [17, 9, 20, 4, 13, 11, 20, 6])


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    root = tmp_path_factory.mktemp("vs_fsdp")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    batch = str(root / "batch.pt")
    make_batch(batch)
    results = {}
    for name, (nproc, spec, backend) in {"fsdp": (1, {}, "fsdp"),
                                         **{k: (*v, "megatron") for k, v in LAYOUTS.items()}}.items():
        out = str(root / f"{name}.pt")
        run_worker(nproc, backend, out, json.dumps({**spec, "steps": STEPS}), model_dir, batch)
        results[name] = torch.load(out)
    return results


def test_one_update_matches_the_fsdp_engine(curves):
    want = curves["fsdp"][0]
    for layout in LAYOUTS:
        got = curves[layout][0]
        assert abs(got["value_loss"] - want["value_loss"]) <= 1e-5, (layout, got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], (layout, got, want)
        assert got["valid_tokens"] == want["valid_tokens"]
        assert abs(got["explained_variance"] - want["explained_variance"]) <= 1e-5


def test_five_steps_follow_the_fsdp_loss_curve(curves):
    want = [m["value_loss"] for m in curves["fsdp"]]
    assert want[-1] < want[0]  # the curve moves, so following it means something
    for layout in LAYOUTS:
        got = [m["value_loss"] for m in curves[layout]]
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert worst <= 1e-4, f"{layout}: {got} vs fsdp {want}"


if __name__ == "__main__":
    run_pytest(__file__)
