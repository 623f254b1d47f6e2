"""engine.cpu_offload on CPU: FSDP2's CPUOffloadPolicy is applied at 1 and 2 ranks (the plumbing a
GPU run takes), the offloaded run computes what the same run without it does, and a sharded build
materialises an offloaded critic's parameters on the CPU whatever the compute device."""

import pytest
import torch

from critic_adapters.backends.fsdp.tests.launch import run_torchrun
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest, save_rollout_batch

WORKER = "critic_adapters.backends.fsdp.tests.cpu_offload_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world size: the worker's results}, one torchrun each, run when a test first asks."""
    root = tmp_path_factory.mktemp("cpu_offload")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    save_rollout_batch(str(root / "batch.pt"), [17, 9, 20, 4, 13, 11, 20])
    done = {}

    def get(world: int) -> dict:
        if world not in done:
            out = root / f"world{world}.pt"
            run_torchrun(world, WORKER, model_dir, str(root / "batch.pt"), str(out))
            done[world] = torch.load(out)
        return done[world]

    return get


def assert_same_run(plain: dict, offload: dict) -> None:
    mask = plain["values"] != 0
    for key in ("values", "values_after"):
        diff = float((offload[key] - plain[key]).abs()[mask].max())
        assert diff <= 1e-6, f"{key} differ by {diff} with engine.cpu_offload=true"
    assert offload["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=1e-9)
    assert offload["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert float((plain["values_after"] - plain["values"]).abs().max()) > 1e-4  # the update moved the critic


def test_cpu_offload_is_applied_on_one_rank_and_changes_no_number(runs):
    results = runs(1)
    plain, offload = results["plain"], results["offload"]
    assert offload["policies"] == ["CPUOffloadPolicy"], offload["policies"]  # honoured, not dropped on CPU
    assert plain["policies"] == [], plain["policies"]  # one rank, fp32: no FSDP at all
    assert_same_run(plain, offload)


def test_sharded_cpu_offload_materialises_on_cpu_and_equals_the_run_without_it(runs):
    """issue 41, item 4: with cpu_offload and 2 shard ranks the sharded build materialised the meta
    tree on the compute device, which FSDP2 refuses on GPU ("FSDP parameters should be materialized
    on CPU when enabling CPU offloading"); it materialises the parameters on the CPU (the buffers on
    the compute device), and the run equals the same run without offloading."""
    results = runs(2)
    plain, offload = results["plain"], results["offload"]
    assert offload["world"] == 2
    assert offload["policies"] == ["CPUOffloadPolicy"] and plain["policies"] == ["OffloadPolicy"], (
        offload["policies"], plain["policies"])
    assert offload["materialised_on"] == ["cpu"] and offload["parameters"] == ["cpu"], offload
    # With a compute device other than the CPU (meta stands in for a GPU): parameters on the CPU,
    # buffers (rotary frequencies) on the compute device.
    assert results["stand_in"] == {"policies": ["CPUOffloadPolicy"], "parameters": ["cpu"], "buffers": ["meta"]}, \
        results["stand_in"]
    assert_same_run(plain, offload)


if __name__ == "__main__":
    run_pytest(__file__)
