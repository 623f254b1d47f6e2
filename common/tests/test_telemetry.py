"""The telemetry the trainer adds to every update (common/job/telemetry.py) and the value / return
statistics of the step (common/engine/update_step.py), against independent counts."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.engine.config import LossConfig
from critic_adapters.common.engine.update_step import StepPlan, StepStats
from critic_adapters.common.job.telemetry import ModelShape, Telemetry, measured_matmul_peak
from critic_adapters.common.parallel.host_memory import MemoryWindow, large_allocations_returned, resident_bytes
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.testdata import tiny_causal_lm
from critic_adapters.common.valuehead.config import critic_class, critic_config


class _Engine:
    def __init__(self, model):
        self.model = model

    def parameter_counts(self):
        params = list(self.model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _critic(family="qwen2", **overrides):
    config = critic_config(tiny_causal_lm(family).config)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return critic_class(config)(config)


def _counted_training_flops(model, lengths) -> int:
    """torch's FlopCounterMode over a forward and backward of one row of each length."""
    counted = 0
    for length in lengths:
        ids = torch.randint(3, 200, (1, length))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids).logits.sum().backward()
        counted += counter.get_total_flops()
    return counted


@pytest.mark.parametrize("frozen", [False, True])
def test_model_flops_are_what_torch_counts_for_a_training_step(frozen):
    """ModelShape.training_flops against torch's FlopCounterMode on a real forward and backward
    (padding-free rows of two lengths; eager attention: full score matrices, as the formula counts them); with a
    mostly frozen critic the frozen weights' gradients are not computed."""
    model = _critic(_attn_implementation="eager")
    if frozen:  # as with LoRA: something trains in the first layer, so gradients flow through every layer
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(("score", "model.layers.0.self_attn.q_proj")))
    shape = ModelShape.of(_Engine(model), model.config)
    counted = _counted_training_flops(model, (24, 40))
    formula = shape.training_flops(torch.tensor([24, 40]))
    # Frozen: the embeddings' output needs no gradient, so part of the first layer's backward is
    # skipped (8% of this 2-layer critic, less with more layers).
    assert formula == pytest.approx(counted, rel=0.10 if frozen else 0.03), (formula, counted)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_counts_the_experts_a_token_goes_through(family):
    """Each token passes top_k of the routed experts (and a shared expert): torch counts the matmuls
    of the experts that run on the tokens routed to them; counting every expert would overstate
    the FLOPs by half (4 experts, top-2). Eager experts: torch has no FLOP formula for the
    grouped matmul transformers runs them with by default."""
    model = _critic(family, _attn_implementation="eager", _experts_implementation="eager")
    shape = ModelShape.of(_Engine(model), model.config)
    counted = _counted_training_flops(model, (24, 40))
    assert shape.training_flops(torch.tensor([24, 40])) == pytest.approx(counted, rel=0.03)


def test_value_and_return_statistics_are_over_response_tokens():
    g = torch.Generator().manual_seed(0)
    values, returns = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g) * 2 + 1
    mask = (torch.rand(4, 9, generator=g) > 0.4).long()
    stats = StepStats(LossConfig(), StepPlan(normalizer=float(mask.sum()), horizon=9), torch.device("cpu"))
    for rows in (slice(0, 1), slice(1, 4)):  # two micro-batches add up
        stats.micro_batch_loss(values[rows], values[rows], returns[rows], mask[rows])
    metrics = stats.metrics(grad_norm=0.0, lr=0.0, tokens=1.0, seconds=1.0, dp_group=None)
    picked_v, picked_r = values[mask.bool()].double(), returns[mask.bool()].double()
    assert metrics["value/mean"] == pytest.approx(float(picked_v.mean()))
    assert metrics["value/std"] == pytest.approx(float(picked_v.std(correction=0)))
    assert metrics["return/mean"] == pytest.approx(float(picked_r.mean()))
    assert metrics["return/std"] == pytest.approx(float(picked_r.std(correction=0)))


def test_an_update_is_measured(monkeypatch):
    """Telemetry around an 'update' that takes 64 MiB for a moment: memory/peak_bytes sees it after
    the fact (the kernel's high-water mark), mfu is the step's model FLOPs over time x peak, and
    the compute_values time is reported with the next update only."""
    model = _critic()
    telemetry = Telemetry(_Engine(model), model.config, torch.device("cpu"))
    assert telemetry.peak_flops > 1e8  # a CPU core does more than 0.1 GFLOP/s of fp32 matmul
    with telemetry.compute_values():
        sum(range(10**5))
    lengths = torch.tensor([30, 50])
    with telemetry.update(lengths) as measured:
        block = torch.ones(64 * 2**20, dtype=torch.uint8)  # touched: resident
        del block
    assert measured["memory/peak_bytes"] >= resident_bytes() + 60 * 2**20
    assert measured["time/compute_values_s"] > 0 and measured["time/update_s"] > 0
    expected = telemetry.shape.training_flops(lengths) / (measured["time/update_s"] * telemetry.peak_flops)
    assert measured["mfu"] == pytest.approx(expected)
    with telemetry.update(lengths) as again:
        pass
    assert again["time/compute_values_s"] == 0.0


def test_a_memory_window_sees_a_short_peak_and_freed_heap_goes_back():
    with large_allocations_returned(), MemoryWindow() as window:
        parts = [torch.ones(2**20) for _ in range(32)]  # 128 MiB in 4 MiB blocks, then freed
        del parts
    assert window.peak - window.base >= 120 * 2**20
    assert window.kept < 16 * 2**20 and window.transient >= 120 * 2**20


def test_the_cpu_peak_is_a_matmul_rate():
    assert measured_matmul_peak(torch.device("cpu"), seconds=0.05) > 1e8


if __name__ == "__main__":
    run_pytest(__file__)
