"""Hybrid sharding (engine.parallel.replicate, fsdp and VeOmni): 4 gloo ranks as 2 replicas x 2
shards give what plain FSDP over the same 4 data-parallel ranks gives (values, loss, grad norm,
the update, the export), and each resumes the other's checkpoint."""

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


@pytest.mark.parametrize("backend", ["fsdp", "veomni"])
def test_two_replicas_of_two_shards_are_plain_fsdp_over_four(tmp_path, model_dir, backend):
    run_torchrun(4, "critic_adapters.tests.hsdp_worker", backend, model_dir, str(tmp_path), timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for rank, out in enumerate(ranks):
        plain, hybrid = out["fsdp4"], out["hsdp2x2"]
        assert plain["dp"] == hybrid["dp"] == (rank, 4)
        # Really hybrid: replicated over one mesh dimension, each rank holding half the rows.
        assert plain["layout"]["placements"] == ["S(0)"]
        assert hybrid["layout"]["placements"] == ["R", "S(0)"]
        assert hybrid["layout"]["local_rows"] * 2 == hybrid["layout"]["rows"] == plain["layout"]["local_rows"] * 4
        for key in ("values_before", "values_after"):
            assert torch.allclose(plain[key], hybrid[key], atol=ATOL), (rank, key)
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
    plain_export = load_critic(str(tmp_path / "fsdp4_export"))[0].state_dict()
    hybrid_export = load_critic(str(tmp_path / "hsdp2x2_export"))[0].state_dict()
    assert all(torch.allclose(plain_export[k], hybrid_export[k], atol=ATOL) for k in plain_export)


def test_replicate_must_divide_the_data_parallel_degree():
    from critic_adapters.common.engine.config import ParallelConfig
    from critic_adapters.common.engine.mesh import mesh_sizes

    assert mesh_sizes(ParallelConfig(replicate=2, ulysses=2), 8)["data"] == 4
    with pytest.raises(ValueError, match="engine.parallel.replicate=3 must divide the data-parallel degree 4"):
        mesh_sizes(ParallelConfig(replicate=3), 4)


if __name__ == "__main__":
    run_pytest(__file__)
