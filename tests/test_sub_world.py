"""An engine on a sub-world (issue 26): a host with 4 gloo ranks gives the critic ranks {2, 3}
(common.engine.mesh.build_mesh(ranks=[2, 3])) and keeps {0, 1} for its actor, which runs collectives of
its own meanwhile (tests/sub_world_worker.py). The fsdp critic loads (rank 2 reads, rank 3 gets
the broadcast), computes the values a plain load gives, takes an update whose loss covers both
critic ranks' tokens, saves and loads a checkpoint, and exports what it holds; so does the VeOmni
critic (VeOmni's parallel state made from the mesh). megatron, whose parallel_state megatron-core
builds over the default group, refuses the sub-world by name."""

import pytest
import torch

from critic_adapters.common.engine import shift_to_tokens
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import installed_backends, run_pytest, save_rollout_batch, skip_without_backend
from critic_adapters.common.tests.torchrun import run_torchrun
from critic_adapters.common.valuehead import compute_values, load_critic


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sub_world")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    batch = save_rollout_batch(str(root / "batch.pt"), [17, 9, 20, 4, 13, 11])
    run_torchrun(4, "critic_adapters.tests.sub_world_worker", model_dir, str(root / "batch.pt"), str(root))
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(4)]
    return {"root": root, "model_dir": model_dir, "batch": batch, "ranks": ranks}


BACKENDS = ("fsdp", "veomni")


def _all_rows(run, backend: str, key: str) -> torch.Tensor:
    """`key` of both critic ranks, put back in the batch's row order."""
    out = torch.zeros(run["batch"]["input_ids"].shape)
    for result in run["ranks"][2:]:
        out[result[backend]["rows"]] = result[backend][key]
    return out


def _plain_values(model_dir, batch) -> torch.Tensor:
    critic, _ = load_critic(model_dir)
    with torch.no_grad():
        return compute_values(critic, batch["input_ids"], batch["attention_mask"]).float()


def test_the_actor_ranks_ran_their_own_collectives_and_the_critic_its(run):
    assert [r["in_critic"] for r in run["ranks"]] == [False, False, True, True]
    assert [r["actor_sum"] for r in run["ranks"][:2]] == [40.0, 40.0]  # 20 all-reduces of 1 + 1
    for backend in installed_backends(BACKENDS):
        assert [r[backend]["dp"] for r in run["ranks"][2:]] == [(0, 2, 2), (1, 2, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sub_world_critic_has_the_plain_critics_values_and_its_update_covers_both_ranks(run, backend):
    skip_without_backend(backend)
    batch, mask = run["batch"], run["batch"]["attention_mask"].bool()
    before = _all_rows(run, backend, "values_before")
    torch.testing.assert_close(before[mask], _plain_values(run["model_dir"], batch)[mask], atol=1e-5, rtol=0)
    # clip_range=None: the value loss is the token-mean squared error of every response token of both ranks
    response = batch["response_mask"].bool()
    residual = (batch["returns"] - shift_to_tokens(before))[response]
    want = 0.5 * float((residual.double() ** 2).mean())
    for result in run["ranks"][2:]:
        metrics = result[backend]["metrics"]
        assert abs(metrics["value_loss"] - want) <= 1e-5 * max(1.0, want), (metrics, want)
        assert metrics["valid_tokens"] == int(response.sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_checkpoint_and_the_export_hold_the_updated_critic(run, backend):
    skip_without_backend(backend)
    mask = run["batch"]["attention_mask"].bool()
    after = _all_rows(run, backend, "values_after")
    assert float((after - _all_rows(run, backend, "values_before"))[mask].abs().max()) > 1e-4  # the update moved it
    assert torch.equal(_all_rows(run, backend, "values_loaded"), after)
    exported = _plain_values(str(run["root"] / backend / "export"), run["batch"])
    torch.testing.assert_close(exported[mask], after[mask], atol=1e-5, rtol=0)


def test_megatron_refuses_a_sub_world_by_name(run):
    for result in run["ranks"][2:]:
        refused = result["refused"]
        assert "the megatron engine runs on every process (megatron-core's dist_checkpointing gathers over the " \
               "default group and writes on global rank 0): the mesh passed in has 2 of the 4 ranks" \
               in refused["megatron"], refused
        assert "use backend fsdp or veomni on a sub-world" in refused["megatron"], refused


def test_megatrons_groups_made_from_the_mesh_are_the_ones_megatron_core_makes(run):
    """parallel_state set from build_mesh(..., backend="megatron") equals megatron-core's own
    initialize_model_parallel, every global on every rank, at each 4-rank layout."""
    for result in run["ranks"]:
        for layout, (ours, theirs) in result["megatron_groups"].items():
            differ = {name: (ours[name], theirs[name]) for name in theirs if ours[name] != theirs[name]}
            assert not differ, (layout, differ)
            assert ours["_TENSOR_MODEL_PARALLEL_GROUP"] is not None


if __name__ == "__main__":
    run_pytest(__file__)
