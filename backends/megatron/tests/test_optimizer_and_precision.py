"""megatron's distributed optimizer (engine.optim.distributed_optimizer, the default on every device)
and bf16 (engine.mixed_precision=bf16) on CPU at data parallel 2: the optimizer, checkpoint format
and precision a GPU run takes are the ones tested here (issue 41, section 2)."""

import pytest
import torch

from critic_adapters.backends.megatron.tests.launch import run_torchrun
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest, save_rollout_batch
from critic_adapters.common.valuehead import compute_values, load_critic

WORKER = "critic_adapters.backends.megatron.tests.optimizer_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(every run of optimizer_worker, the HF critic's fp32 values, the mask): one torchrun, 2 ranks."""
    root = tmp_path_factory.mktemp("optimizer")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    data = save_rollout_batch(str(root / "batch.pt"), [17, 9, 20, 4, 13, 11])
    work = root / "work"
    work.mkdir()
    run_torchrun(2, WORKER, model_dir, str(root / "batch.pt"), str(work))
    with torch.no_grad():
        reference = compute_values(load_critic(model_dir)[0], data["input_ids"], data["attention_mask"])
    return torch.load(work / "result.pt"), reference, data["attention_mask"].bool()


def max_diff(a, b, mask) -> float:
    return float((a - b).abs()[mask].max())


def numbers(metrics: list[dict]) -> list[dict]:
    """The metrics an update computes (not its timing)."""
    return [{key: m[key] for key in ("value_loss", "grad_norm", "explained_variance", "lr")} for m in metrics]


def test_the_distributed_optimizer_is_the_default_and_steps_as_the_plain_one(runs):
    results, reference, mask = runs
    distributed, plain = results["fp32-distributed"], results["fp32-plain"]
    assert distributed["optimizers"] == ["DistributedOptimizer"], distributed["optimizers"]
    assert plain["optimizers"] == ["FP32Optimizer"], plain["optimizers"]
    assert max_diff(distributed["values"], reference, mask) <= 1e-5
    for got, want in zip(distributed["metrics"], plain["metrics"], strict=True):
        assert got["value_loss"] == pytest.approx(want["value_loss"], rel=1e-6), (got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got, want)
    assert max_diff(distributed["values_after"], plain["values_after"], mask) <= 1e-5
    assert max_diff(distributed["values_after"], distributed["values"], mask) > 1e-3  # the updates moved it


def test_a_checkpoint_resumes_only_with_the_optimizer_that_wrote_it(runs):
    results, _, mask = runs
    saved, resumed = results["fp32-distributed"], results["fp32-resumed"]
    assert saved["meta"]["distributed_optimizer"] is True
    # The same update after the load (weights, Adam's moments and step restored), bit for bit.
    assert numbers(resumed["metrics"]) == numbers(saved["metrics"][2:])
    assert torch.equal(resumed["values_after"], saved["values_after"])
    refused = results["fp32-plain"]["refused"]
    assert "distributed optimizer" in refused and "engine.optim.distributed_optimizer=true" in refused, refused


def test_bf16_trains_with_falling_loss_close_to_fp32_with_either_optimizer(runs):
    results, reference, mask = runs
    for name, optimizer in (("bf16-distributed", "DistributedOptimizer"),
                            ("bf16-plain", "Float16OptimizerWithFloat16Params")):
        run = results[name]
        assert run["optimizers"] == [optimizer] and run["dtypes"] == ["torch.bfloat16"], (name, run["optimizers"],
                                                                                          run["dtypes"])
        losses = [m["value_loss"] for m in run["metrics"]]
        assert len(losses) == 5 and losses[-1] < 0.9 * losses[0], (name, losses)
        diff = max_diff(run["values"], reference, mask)
        assert 0 < diff < 0.05, f"{name}: bf16 values differ from fp32 by {diff}"  # close, and really bf16
    saved, resumed = results["bf16-distributed"], results["bf16-resumed"]
    assert saved["meta"]["distributed_optimizer"] is True
    assert numbers(resumed["metrics"]) == numbers(saved["metrics"][2:])
    assert torch.equal(resumed["values_after"], saved["values_after"])


@pytest.mark.parametrize("layout", ["pieces-dp2", "pieces-tp2-sp"])
def test_the_step_in_pieces_reduces_its_gradients_once(runs, layout):
    """forward_backward twice, then step_optimizer, takes the step one call over the same rows does:
    the gradients are reduced once per step (a reduction per call counted the first call's again
    under the distributed optimizer's reduce-scatter and the sequence-parallel norms' sum)."""
    results, _, mask = runs
    one, two = results[layout][1], results[layout][2]
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), (two["grad_norm"], one["grad_norm"])
    assert max_diff(two["values_after"], one["values_after"], mask) <= 1e-5


if __name__ == "__main__":
    run_pytest(__file__)
