"""Hybrid sharding (engine.parallel.replicate, fsdp and VeOmni): 4 gloo ranks as 2 replicas x 2
shards give what plain FSDP over the same 4 data-parallel ranks gives (values, loss, grad norm,
the update, the export), and each resumes the other's checkpoint; gradients cross the replicas
once per optimizer step, not once per micro-batch, and the step is the same."""

import pytest
import torch

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun
from critic_adapters.common.valuehead import load_critic

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_causal_lm("qwen2", str(tmp_path_factory.mktemp("model") / "qwen2"))


@pytest.fixture(scope="module", params=["fsdp", "veomni"])
def hsdp_run(request, tmp_path_factory, model_dir):
    """(the worker's output directory, each rank's output) on one backend: one torchrun serves every
    test of that backend."""
    out_dir = tmp_path_factory.mktemp(f"hsdp_{request.param}")
    run_torchrun(4, "critic_adapters.tests.hsdp_worker", request.param, model_dir, str(out_dir), timeout=900)
    return out_dir, [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_two_replicas_of_two_shards_are_plain_fsdp_over_four(hsdp_run):
    out_dir, ranks = hsdp_run
    for rank, out in enumerate(ranks):
        plain, hybrid = out["fsdp4"], out["hsdp2x2"]
        assert plain["dp"] == hybrid["dp"] == (rank, 4)
        # Really hybrid: replicated over one mesh dimension, each rank holding half the rows.
        assert plain["layout"]["placements"] == ["S(0)"]
        assert hybrid["layout"]["placements"] == ["R", "S(0)"]
        assert hybrid["layout"]["local_rows"] * 2 == hybrid["layout"]["rows"] == plain["layout"]["local_rows"] * 4
        for key in ("values_before", "values_after"):
            assert torch.allclose(plain[key], hybrid[key], atol=ATOL), (rank, key)
        # The job plan's bytes (common.engine.memory) after the step: parameters and optimizer state exact.
        for layout in (plain, hybrid):
            params, _, optimizer = layout["memory"]["planned"]
            resident = layout["memory"]["resident"]
            assert (params, optimizer) == (resident["model"], resident["optimizer"]), (rank, layout["memory"])
        for key in ("value_loss", "grad_norm", "explained_variance", "valid_tokens"):
            assert plain["metrics"][key] == pytest.approx(hybrid["metrics"][key], abs=ATOL), (rank, key)
        # Resumed across replicate degrees: where the other layout's update left the critic, then
        # the same next update.
        assert torch.allclose(plain["values_resumed"], hybrid["values_after"], atol=ATOL), rank
        assert torch.allclose(hybrid["values_resumed"], plain["values_after"], atol=ATOL), rank
        assert plain["metrics_resumed"]["value_loss"] == pytest.approx(hybrid["metrics_resumed"]["value_loss"], abs=ATOL)
        assert plain["metrics_resumed"]["grad_norm"] == pytest.approx(hybrid["metrics_resumed"]["grad_norm"], abs=ATOL)
    # The update moved the critic (else the comparisons above say little), and both exports are it.
    assert not torch.allclose(ranks[0]["fsdp4"]["values_before"], ranks[0]["fsdp4"]["values_after"], atol=1e-3)
    plain_export = load_critic(str(out_dir / "fsdp4_export"))[0].state_dict()
    hybrid_export = load_critic(str(out_dir / "hsdp2x2_export"))[0].state_dict()
    assert all(torch.allclose(plain_export[k], hybrid_export[k], atol=ATOL) for k in plain_export)


def test_replicas_reduce_gradients_once_per_step(hsdp_run):
    """Three micro-batches a step (hsdp_worker.reduction_runs): every micro-batch's backward
    reduce-scatters within the replica, and only the last one all-reduces across replicas, once per
    FSDP unit; the step (loss, grad norm, the values after) is the one FSDP2's all-reduce after
    every micro-batch gives. forward_backward, whose caller decides when to step, still all-reduces
    every call, and a step that failed part-way leaves nothing in the next one."""
    _, ranks = hsdp_run
    micro_batches = 3
    for rank, out in enumerate(ranks):
        runs = out["reduction"]
        units = runs["units"]
        assert units > 1, rank
        assert runs["each"]["counts"] == {"all_reduce": micro_batches * units,
                                          "reduce_scatter_single": micro_batches * units}, rank
        for name in ("once", "after_failure"):
            assert runs[name]["counts"] == {"all_reduce": units, "reduce_scatter_single": micro_batches * units}, \
                (rank, name)
            for key in ("value_loss", "grad_norm", "explained_variance"):
                assert runs[name]["metrics"][key] == pytest.approx(runs["each"]["metrics"][key], abs=ATOL), \
                    (rank, name, key)
            assert torch.allclose(runs[name]["values_after"], runs["each"]["values_after"], atol=ATOL), (rank, name)
        assert runs["forward_backward"] == {"all_reduce": units, "reduce_scatter_single": units}, rank
    # The update moved the critic: the values after it are not the ones before.
    assert not torch.allclose(ranks[0]["reduction"]["each"]["values_after"], ranks[0]["hsdp2x2"]["values_before"],
                              atol=1e-3)


def test_replicate_must_divide_the_data_parallel_degree():
    from critic_adapters.common.engine.config import ParallelConfig
    from critic_adapters.common.engine.mesh import mesh_sizes

    assert mesh_sizes(ParallelConfig(replicate=2, ulysses=2), 8)["data"] == 4
    with pytest.raises(ValueError, match="engine.parallel.replicate=3 must divide the data-parallel degree 4"):
        mesh_sizes(ParallelConfig(replicate=3), 4)


if __name__ == "__main__":
    run_pytest(__file__)
