"""The engine contract, checked the same way for every registered backend, at every two-rank
layout its spec offers.

Each backend runs tests/conformance/worker.py once on 2 gloo ranks (data parallel 2, then each
model-parallel layout of its spec: tensor, pipeline, context, ulysses 2); the tests below read what
each rank saw. Every backend in common.engine.registry.BACKENDS when this file is collected is a parameter,
so a backend a host registers with register_backend (in a conftest or a plugin loaded first, `pytest
-p`) runs them too; the worker gets its spec. Bazel's one target shards by backend (each shard runs
whole backends); CONFORMANCE_BACKEND=<name> selects one.
"""

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.common.engine.registry import BACKENDS
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun, worker_env
from critic_adapters.common.valuehead import compute_values
from critic_adapters.common.tests.checkpoint_builders import moe_token_classification
from critic_adapters.tests.conformance.worker import TIMEOUT_S, layouts, moe_layouts, rollout, spec_json

# The mixture-of-experts fixture every built-in backend takes (VeOmni models qwen3_moe, not qwen2_moe
# or mixtral); a host backend that takes no MoE critic fails test_a_mixture_of_experts_critic_*.
MOE_FAMILY = "qwen3_moe"

SELECTED = os.environ.get("CONFORMANCE_BACKEND")
NAMES = [SELECTED] if SELECTED else sorted(BACKENDS)


@pytest.fixture(scope="module", params=NAMES)
def run(request, tmp_path_factory):
    backend = request.param
    root = tmp_path_factory.mktemp(f"conformance-{backend}")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    moe_dir, _ = moe_token_classification(str(root), MOE_FAMILY)
    work = root / "work"
    work.mkdir()
    run_torchrun(2, "critic_adapters.tests.conformance.worker", backend, model_dir, str(work),
                 "--spec", spec_json(BACKENDS[backend]), "--moe", moe_dir,
                 env=worker_env(PYTHONWARNINGS="ignore"), timeout=900)
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    return backend, work, ranks


def shard_key(item) -> str:
    """Bazel shards this file by backend: a shard runs every test of the backends it gets."""
    return item.callspec.params["run"] if hasattr(item, "callspec") else ""


def test_every_rank_knows_its_data_parallel_coordinates_from_the_mesh(run):
    _, _, ranks = run
    for rank in ranks:
        c = rank["coords"]
        assert (c["parallel_dp_rank"], c["parallel_dp_size"]) == (c["dp_rank"], c["dp_size"]) == (c["dp_rank"], 2)
        assert c["dp_group_size"] == 2
        assert rank["all_dp_ranks"] == [0, 1]


def check_pieces(pieces: dict, data_parallel_ranks: int) -> None:
    """What worker.step_in_pieces saw: forward_backward's values are compute_values', its loss moves
    the critic, the counts and the adapter export a critic without LoRA refuses."""
    assert pieces["values_diff"] <= 1e-5 and pieces["loss_without_fn"] is None, pieces
    assert pieces["returned"] == ["cpu torch.float32"] * 3, pieces["returned"]  # detached, on the CPU
    assert pieces["loss"] > 0 and pieces["grad_norm"] > 0 and pieces["moved"] > 1e-6, pieces
    trainable, total = pieces["counts"]
    assert 0 < trainable == total, pieces["counts"]
    assert pieces["data_parallel_ranks"] == data_parallel_ranks
    assert pieces["adapter"] is not None and "engine.lora.rank=0" in pieces["adapter"], pieces["adapter"]
    memory = pieces["memory"]  # the job plan's bytes (common.engine.memory) where it computes them: exact
    assert memory["planned"] is None or memory["planned"] == memory["resident"], memory


def test_every_engine_has_the_whole_contract_and_its_pieces_work(run):
    _, _, ranks = run
    for rank in ranks:
        assert rank["missing_members"] == [], rank["missing_members"]
        assert rank["coords"]["dp_size"] == 2
        check_pieces(rank["pieces"], 2)


def test_every_layout_the_backend_offers_runs_the_whole_contract_with_the_same_critic(run):
    """Each model-parallel layout of two ranks (one data-parallel rank): the main pass's export loads
    with its values, every method works, a reloaded checkpoint takes the same next step, the export
    holds the engine's values; exactly one of the two ranks reports outputs."""
    backend, work, ranks = run
    names = layouts(BACKENDS[backend])
    assert names, f"{backend} offers no model-parallel layout"  # every built-in one does
    for name in names:
        seen = [rank["layouts"][name] for rank in ranks]
        assert sum(s["reports_outputs"] for s in seen) == 1, name
        for s in seen:
            assert s["degrees"][name] == 2 and s["dp"] == [0, 1] and s["dp_group_size"] == 1, (name, s)
        check_layout_pass(work, name, seen, data_parallel_ranks=1)


def check_layout_pass(work, name: str, seen: list[dict], *, data_parallel_ranks: int) -> None:
    """What worker.layout_pass saw on every rank, and its export against its values."""
    for s in seen:
        assert s["missing_members"] == [], (name, s["missing_members"])
        assert s["values_diff"] <= 1e-4, (name, s["values_diff"])
        check_pieces(s["pieces"], data_parallel_ranks)
        assert math.isfinite(s["first_update"]["value_loss"]) and s["first_update"]["grad_norm"] > 0, name
        assert s["reload_values_diff"] <= 1e-6, (name, s["reload_values_diff"])
        # a load and an offload / onload cycle before the step: the same step, bit for bit
        assert s["reloaded_update"] == s["next_update"], (name, s["reloaded_update"], s["next_update"])
        assert s["offloaded_after_export"] == ["grads", "model", "optimizer"], name
    model = AutoModelForTokenClassification.from_pretrained(str(work / f"hf_export-{name}"))
    batch = rollout(0)
    with torch.no_grad():
        got = compute_values(model, batch.input_ids, batch.attention_mask)
    expected = torch.load(work / f"values-{name}.pt")
    assert float((got - expected).abs()[batch.attention_mask.bool()].max()) <= 1e-4, name


def test_a_mixture_of_experts_critic_runs_the_whole_contract(run):
    """The same pass on a qwen3_moe critic written by transformers, at data parallel 2 and, where the
    backend offers it, expert parallel 2: values equal transformers', every method works, a reloaded
    checkpoint takes the same next step, the export holds the engine's values."""
    backend, work, ranks = run
    for name in moe_layouts(BACKENDS[backend]):
        seen = [rank["moe"][name] for rank in ranks]
        assert [s["dp"] for s in seen] == [[0, 2], [1, 2]], name  # (expert parallelism spans data ranks)
        check_layout_pass(work, name, seen, data_parallel_ranks=2)


def test_token_balanced_shares_change_where_the_work_runs_not_the_step(run):
    """Two rows 8x longer than six others: shared r::n, one rank holds both; balanced by tokens,
    each holds one. The update (loss normalised over the whole mini-batch) is the same either way."""
    _, _, ranks = run
    for rank in ranks:
        shares = rank["shares"]
        strided, balanced = shares["strided"], shares["balanced"]
        assert strided["largest_share_tokens"] == 108 and balanced["largest_share_tokens"] == 66, shares
        for key, value in strided["metrics"].items():
            assert balanced["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, shares)
        assert shares["values_diff"] <= 1e-5, shares


def optimizer_reference(export_dir: str, name: str) -> dict:
    """One step of plain transformers on the export with torch's own optimizers on the same parameter
    groups (Muon: muon_parameters, lr matched to AdamW's RMS; AdamW on the rest), over both ranks'
    mini-batch shares (rollout(2), rollout(3)), clipped loss (0.2 around old values 0), clip 1.0."""
    from critic_adapters.common.engine import shift_to_tokens
    from critic_adapters.common.engine.optimizers import muon_parameters
    from critic_adapters.common.learning.loss import value_loss
    from critic_adapters.tests.conformance.worker import rollout as make_rollout

    model = AutoModelForTokenClassification.from_pretrained(export_dir, torch_dtype=torch.float32)
    muon = set(muon_parameters(model)) if name.startswith("muon") else set()
    named = list(model.named_parameters())
    optimizers = [torch.optim.AdamW([p for n, p in named if n not in muon], lr=1e-3, weight_decay=0.0)]
    if muon:
        optimizers.append(torch.optim.Muon([p for n, p in named if n in muon], lr=1e-3, weight_decay=0.0,
                                           adjust_lr_fn="match_rms_adamw"))
    first = make_rollout(0)

    def values(batch):
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0]

    with torch.no_grad():
        before = values(first)
    parts = [make_rollout(2), make_rollout(3)]
    cat = {f: torch.cat([getattr(b, f) for b in parts]) for f in ("input_ids", "attention_mask", "response_mask",
                                                                     "old_values", "returns")}
    model.train()
    predictions = shift_to_tokens(model(input_ids=cat["input_ids"], attention_mask=cat["attention_mask"]).logits[..., 0])
    loss, _ = value_loss(predictions, cat["old_values"], cat["returns"], cat["response_mask"], clip_range=0.2)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for optimizer in optimizers:
        optimizer.step()
    model.eval()
    with torch.no_grad():
        after = values(first)
    real = first.attention_mask.bool()
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "before": before[real], "after": after[real],
            "real": real, "muon": len(muon)}


def test_each_optimizer_option_steps_as_torchs_own_and_offloaded_state_changes_nothing(run):
    """Issue 44, 1: engine.optim.name=muon equals torch's Muon + AdamW on the same parameter groups (the
    fsdp/veomni shards gathered per matrix), bf16 state is within a bf16 rounding of fp32 AdamW's step,
    offload_state keeps no optimizer bytes on the device between steps (after a save and a load too) and
    trains bit-identically; a backend without an option refuses it by name."""
    from critic_adapters.common.engine.registry import BACKENDS
    from critic_adapters.tests.conformance.worker import OPTIMIZER_OPTIONS

    backend, work, ranks = run
    spec = BACKENDS[backend]
    export_dir = str(work / "hf_export")
    references = {}
    for rank in ranks:
        options = rank["optimizers"]
        plain = options["adamw"]
        for name, (knob, _) in OPTIMIZER_OPTIONS.items():
            result = options[name]
            if knob not in spec.knobs:
                assert result["refused"] and f"engine.{knob}=" in result["refused"], (name, result)
                continue
            # The job plan's optimizer bytes of the option (common.engine.memory), where it computes them: exact.
            assert result["planned"] is None or result["planned"][2] == result["optimizer_bytes_after_step"], \
                (name, result["planned"], result["optimizer_bytes_after_step"])
            if name == "offload_state":
                assert result["metrics"] == plain["metrics"] and result["next"] == plain["next"], (result, plain)
                assert result["values_after"] == plain["values_after"]  # bit for bit
                assert result["optimizer_bytes_after_step"] == result["optimizer_bytes_after_load"] == 0, result
                assert result["offloaded_after_step"] == ["optimizer"], result
                continue
            if name == "muon":
                raised = result["adamw_checkpoint"]["raised"]
                assert raised and "holds the optimizer state of engine.optim.name=adamw, and this engine has " \
                                  "engine.optim.name=muon" in raised["message"], result["adamw_checkpoint"]
            reference = references.get(name) or references.setdefault(name, optimizer_reference(export_dir, name))
            assert reference["muon"] > 0 or not name.startswith("muon")
            assert result["metrics"]["value_loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-6), name
            assert result["metrics"]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), name
            after = torch.tensor(result["values_after_first"])[reference["real"]]
            step = float((reference["after"] - reference["before"]).abs().max())
            # fp32 state: torch's step; bf16 state: within 5% of the step (the moments rounded to 8 bits).
            tolerance = 2e-4 if "bf16" not in name else 0.05 * step
            diff = float((after - reference["after"]).abs().max())
            assert diff <= tolerance < step, (name, diff, tolerance, step)


def test_the_version_counts_optimizer_steps_and_a_checkpoint_keeps_it_and_a_hosts_tensors(run):
    """Issue 44, 3: engine.version (optimizer steps), compute_values(return_version=True), and a host's
    extra tensors (a replay buffer) saved with the checkpoint and back from load_checkpoint, bit for bit,
    in a new engine: each rank's own (issue 49: ranks' tensors that differ were dropped for rank 0's)."""
    _, _, ranks = run
    for rank in ranks:
        version = rank["version"]
        assert version["fresh_engine"] == 0 < version["before_update"], version
        assert version["after_update"] == version["before_update"] + 1 == version["values_version"], version
        assert version["resumed"] == version["after_update"], version
        assert rank["extra"]["state"] == {"position": 7}, rank["extra"]
        assert rank["extra"]["tensors_are_this_ranks"], rank["extra"]  # each rank's own, nothing dropped


def test_an_update_with_a_value_mask_counts_only_those_tokens(run):
    """RolloutBatch.value_mask: the loss, its normalisation over both ranks' micro-batches and the
    step are those of a loss over the value-mask tokens alone (a reference computed from the values
    before the step; the same step as response_mask = value_mask), not the plain step's."""
    _, _, ranks = run
    for rank in ranks:
        step = rank["value_mask"]
        masked, reference = step["masked"], step["reference"]
        assert masked["value_loss"] == pytest.approx(reference["value_loss"], rel=1e-5, abs=1e-7), step
        assert masked["valid_tokens"] == reference["valid_tokens"] < step["plain"]["valid_tokens"], step
        for key in ("value_loss", "grad_norm", "explained_variance"):
            assert masked[key] == pytest.approx(step["as_response"][key], rel=1e-6, abs=1e-7), (key, step)
        assert step["after_diff"]["as_response"] <= 1e-6, step
        assert step["after_diff"]["plain"] > 1e-5, step  # the mask changed the step


def test_the_critic_steps_off_the_device_and_back_between_phases(run):
    _, _, ranks = run
    for rank in ranks:
        o = rank["offload"]
        assert o["rollout_phase"] == ["grads", "optimizer"] and o["rollout_values_equal"], o
        assert o["rollout_bytes"]["model"] > 0 and o["rollout_bytes"]["optimizer"] == o["rollout_bytes"]["grads"] == 0
        assert "update: the critic's grads and optimizer are offloaded" in o["update_refused"]["message"], o
        assert "call engine.onload() first" in o["update_refused"]["message"], o
        assert o["offloaded"] == ["grads", "model", "optimizer"], o
        assert o["offloaded_bytes"] == {"model": 0, "grads": 0, "optimizer": 0}, o
        assert "compute_values: the critic's model is offloaded" in o["values_refused"]["message"], o
        assert o["model_back"] == {"offloaded": ["grads", "optimizer"], "values_equal": True}, o
        assert o["after_onload"] == [] and o["values_equal_after"], o
        before, after = o["resident"]
        assert after["optimizer"] == before["optimizer"] > 0 and after["grads"] == before["grads"], o
        # an FSDP2 root left unsharded by the forward counts its gathered parameters until offload reshards it
        assert 0 < after["model"] <= before["model"], o


@pytest.mark.parametrize("step, failing_rank, message", [
    ("failing_save", 0, "No space left on device"),
    ("failing_load", 1, "Input/output error"),
    ("failing_export", 0, "not_a_directory"),
])
def test_a_save_load_or_export_failing_on_one_rank_raises_on_every_rank_with_its_message(run, step, failing_rank,
                                                                                        message):
    _, _, ranks = run
    outcomes = [r[step] for r in ranks]
    assert all(o["raised"] is not None for o in outcomes), outcomes
    # The failing rank raises its own error; the other an error of the same kind naming that rank and its message.
    assert all(o["raised"]["kind"] == "OSError" and message in o["raised"]["message"] for o in outcomes), outcomes
    other = outcomes[1 - failing_rank]["raised"]["message"]
    assert f"failed on rank {failing_rank}: " in other, other
    assert all(o["seconds"] < TIMEOUT_S for o in outcomes), outcomes  # nobody waited for a timeout


def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_no_staging(run):
    _, work, ranks = run
    assert all(r["staging_left"] == [] for r in ranks)
    assert all(r["old_checkpoint_values_diff"] == 0.0 for r in ranks)


def test_nan_returns_on_one_rank_are_refused_on_every_rank(run):
    _, _, ranks = run
    messages = [r["nan"]["raised"] for r in ranks]
    assert all(m is not None for m in messages), messages
    assert "another rank" in messages[0] and "returns has 1 non-finite" in messages[1], messages
    assert "rollout data" in messages[1], messages
    assert [r["nan"]["values_diff"] for r in ranks] == [0.0, 0.0]  # refused before any weight moved
    assert all(math.isfinite(r["after_nan_loss"]) and r["after_nan_loss"] > 0 for r in ranks)


def test_a_second_engine_resumes_the_checkpoint_exactly(run):
    _, _, ranks = run
    for rank in ranks:
        assert rank["resume_values_diff"] <= 1e-6
        assert {"value_loss", "grad_norm", "explained_variance", "lr"} <= set(rank["metrics_keys"])


def test_an_export_and_an_offload_cycle_change_no_later_update(run):
    """The first engine exported and went through offload/onload before its next update; the second,
    resumed from the same checkpoint, did neither: the updates and the values after are the same
    (an export once left megatron's embedding, norms and head with no gradient after an offload)."""
    _, _, ranks = run
    for rank in ranks:
        cycled, plain = rank["next_update"], rank["resumed_next_update"]
        assert cycled["value_loss"] == pytest.approx(plain["value_loss"], rel=1e-6, abs=1e-9)
        assert cycled["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5), (cycled["grad_norm"],
                                                                                    plain["grad_norm"])
        diff = (torch.tensor(cycled["values_after"]) - torch.tensor(plain["values_after"])).abs().max()
        assert float(diff) <= 1e-6, float(diff)


def test_the_export_is_a_plain_token_classification_critic_with_the_engine_values(run):
    _, work, _ = run
    model, info = AutoModelForTokenClassification.from_pretrained(str(work / "hf_export"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.num_labels == 1 and model.config.architectures == ["Qwen2ForTokenClassification"]
    for r in range(2):
        batch = rollout(r)
        expected = torch.load(work / f"values{r}.pt")
        with torch.no_grad():
            got = compute_values(model, batch.input_ids, batch.attention_mask)
        mask = batch.attention_mask.bool()
        assert float((got - expected).abs()[mask].max()) <= 1e-4


def test_engines_leave_the_process_as_they_found_it(run):
    _, _, ranks = run
    for rank in ranks:
        assert rank["side_effects"] == [], rank["side_effects"]


def test_no_gloo_worker_thread_outlives_shutdown(run):
    """A gloo group alive at interpreter exit can abort the process (common.parallel.distributed.shutdown)."""
    _, _, ranks = run
    assert [r["gloo_threads_after_shutdown"] for r in ranks] == [0, 0]


if __name__ == "__main__":
    run_pytest(__file__, shard_key=shard_key)
