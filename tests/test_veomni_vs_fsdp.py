"""The VeOmni engine trains like the FSDP engine: one update on the same batch gives the same loss
(<= 1e-5) and grad norm (<= 1e-4 relative), and 5 steps at 1 and 2 ranks follow the FSDP engine's
loss curve (<= 1e-4): the optimizer steps the parameters the model computes with."""

import json

import pytest
import torch

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.tests.test_megatron_vs_fsdp import make_batch, run_worker

STEPS = 5
RUNS = {"fsdp": ("fsdp", 1), "veomni-1": ("veomni", 1), "veomni-2": ("veomni", 2)}


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    root = tmp_path_factory.mktemp("veomni_vs_fsdp")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    batch = str(root / "batch.pt")
    make_batch(batch)
    results = {}
    for name, (backend, nproc) in RUNS.items():
        out = str(root / f"{name}.pt")
        run_worker(nproc, backend, out, json.dumps({"steps": STEPS}), model_dir, batch)
        results[name] = torch.load(out)
    return results


def test_one_update_matches_the_fsdp_engine(curves):
    want = curves["fsdp"][0]
    for run in ("veomni-1", "veomni-2"):
        got = curves[run][0]
        assert abs(got["value_loss"] - want["value_loss"]) <= 1e-5, (run, got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], (run, got, want)
        assert got["valid_tokens"] == want["valid_tokens"]
        assert abs(got["explained_variance"] - want["explained_variance"]) <= 1e-5


def test_five_steps_follow_the_fsdp_loss_curve(curves):
    want = [m["value_loss"] for m in curves["fsdp"]]
    assert want[-1] < want[0]  # the curve moves, so following it means something
    for run in ("veomni-1", "veomni-2"):
        got = [m["value_loss"] for m in curves[run]]
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert worst <= 1e-4, f"{run}: {got} vs fsdp {want}"


if __name__ == "__main__":
    run_pytest(__file__)
