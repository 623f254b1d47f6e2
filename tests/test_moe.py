"""Mixture-of-experts critics (mixtral, qwen2_moe with its gated shared expert, qwen3_moe) on every
backend that takes them, checked against transformers itself on checkpoints transformers wrote:
megatron at expert parallel 2, expert parallel 1 (data parallel 2), tensor parallel 2 (with the
sequence parallelism megatron's MoE layer needs) and pipeline parallel 2; fsdp; VeOmni's own MoE
modeling (qwen3_moe, deepseek_v3); fsdp and VeOmni on deepseek_v3 too; from transformers' TokenCls, a trl value head and a sidecar head. Each run's
values equal transformers' forward (<= 1e-4), and one update equals
an independent transformers + AdamW step on every data-parallel rank's rollout (the value loss
alone, or with engine.loss.router_aux_coef the value loss plus transformers' router load-balancing
loss, reported apart as router_aux_loss). A megatron checkpoint written at expert parallel 2 resumes
at expert parallel 1 identically; its HF export loads in plain transformers with the engine's values."""

import json

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.common.engine import shift_to_tokens
from critic_adapters.common.engine.config import EngineConfig, LoRAConfig, ModelConfig, ParallelConfig
from critic_adapters.common.engine.registry import backend_spec
from critic_adapters.common.learning.loss import value_loss
from critic_adapters.common.testdata import MOE_FAMILIES, tiny_config
from critic_adapters.common.tests import checkpoint_builders
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun, worker_env
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.tests.conformance.worker import rollout
from critic_adapters.tests.moe_worker import EPS, LR

AUX = 0.5  # engine.loss.router_aux_coef of the *-aux runs
# name: (backend, checkpoint (a family: its TokenCls), engine.parallel, worker options); run in this order
# (a resume after its save).
RUNS = {
    **{f"megatron-ep2-{f}": ("megatron", f, {"expert": 2}, {}) for f in MOE_FAMILIES},
    **{f"megatron-tp2-{f}": ("megatron", f, {"tensor": 2, "sequence_parallel": True}, {}) for f in MOE_FAMILIES},
    "megatron-ep1-qwen2_moe": ("megatron", "qwen2_moe", {}, {}),
    # The other formats load_critic reads for these families: a trl value head, a sidecar head.
    "megatron-ep2-trl-qwen3_moe": ("megatron", "trl-qwen3_moe", {"expert": 2}, {}),
    "megatron-ep2-sidecar-mixtral": ("megatron", "sidecar-mixtral", {"expert": 2}, {}),
    "megatron-pp2-qwen2_moe": ("megatron", "qwen2_moe", {"pipeline": 2}, {}),
    "megatron-ep2-saves": ("megatron", "qwen3_moe", {"expert": 2}, {"save": True, "export": True}),
    "megatron-ep1-resumes": ("megatron", "qwen3_moe", {}, {"resume": "megatron-ep2-saves"}),
    **{f"fsdp-{f}": ("fsdp", f, {}, {}) for f in MOE_FAMILIES},
    "veomni-qwen3_moe": ("veomni", "qwen3_moe", {}, {}),
    # deepseek_v3 (sigmoid router, a shared expert, a dense first layer): fsdp, and VeOmni's modeling.
    "fsdp-deepseek_v3": ("fsdp", "deepseek_v3", {}, {}),
    "veomni-deepseek_v3": ("veomni", "deepseek_v3", {}, {}),
    # engine.loss.router_aux_coef: transformers' load-balancing loss added with it.
    "megatron-ep2-qwen2_moe-aux": ("megatron", "qwen2_moe", {"expert": 2}, {"router_aux_coef": AUX}),
    "megatron-tp2-mixtral-aux": ("megatron", "mixtral", {"tensor": 2, "sequence_parallel": True},
                                 {"router_aux_coef": AUX}),
    "fsdp-qwen2_moe-aux": ("fsdp", "qwen2_moe", {}, {"router_aux_coef": AUX}),
    "veomni-qwen3_moe-aux": ("veomni", "qwen3_moe", {}, {"router_aux_coef": AUX}),
}
TRAINING_RUNS = sorted(name for name, (*_, options) in RUNS.items() if "resume" not in options)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe"))
    paths = {family: checkpoint_builders.moe_token_classification(root, family)[0]
             for family in (*MOE_FAMILIES, "deepseek_v3")}
    paths["trl-qwen3_moe"] = checkpoint_builders.moe_trl(root, "qwen3_moe")[0]
    paths["sidecar-mixtral"] = checkpoint_builders.moe_trl(root, "mixtral", sidecar=True)[0]
    return paths


@pytest.fixture(scope="module")
def results(checkpoints, tmp_path_factory):
    """{run: result.pt of tests/moe_worker.py}: every run in one torchrun of 2 processes."""
    specs, works = {}, {}
    for name, (backend, checkpoint, parallel, options) in RUNS.items():
        works[name] = tmp_path_factory.mktemp(name)
        specs[name] = {"backend": backend, "model": checkpoints[checkpoint], "parallel": parallel,
                       "workdir": str(works[name]), **options}
    run_torchrun(2, "critic_adapters.tests.moe_worker", json.dumps(specs), env=worker_env(PYTHONWARNINGS="ignore"),
                 timeout=900)
    return {name: (works[name], torch.load(works[name] / "result.pt")) for name in RUNS}


def reference(checkpoint: str):
    model, report = load_critic(checkpoint)
    assert report.head == "loaded", report
    return model


def real(batch):
    return batch.attention_mask.bool()


@pytest.mark.parametrize("name", TRAINING_RUNS)
def test_values_equal_transformers(name, results, checkpoints):
    _, result = results[name]
    model = reference(checkpoints[RUNS[name][1]])
    assert sorted(result["values_before"]) == list(range(result["data_ranks"]))
    for rank, values in result["values_before"].items():
        batch = rollout(rank)
        expected = compute_values(model, batch.input_ids, batch.attention_mask)
        assert torch.allclose(values[real(batch)], expected[real(batch)], atol=1e-4), \
            (values[real(batch)] - expected[real(batch)]).abs().max()


def test_the_values_check_sees_a_misplaced_expert(checkpoints):
    """Negative control: the fixtures' experts matter, so a converter that swapped two experts (or
    routed to the wrong ones) would fail the check above by far more than its tolerance."""
    model = reference(checkpoints["qwen3_moe"])
    batch = rollout(0)
    expected = compute_values(model, batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        for layer in model.model.layers:
            for tensor in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                tensor.copy_(tensor[[1, 0, 2, 3]])
    swapped = compute_values(model, batch.input_ids, batch.attention_mask)
    assert (swapped - expected)[real(batch)].abs().max() > 1e-2


def router_loss(model, batch) -> torch.Tensor:
    """transformers' load-balancing loss of one forward pass over `batch`: the routers' logits of
    every layer (mixtral's, qwen's `mlp.gate`), padding masked out by transformers' own function."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = []
    hooks = [module.register_forward_hook(lambda m, i, out: logits.append(out[0]))
             for name, module in model.named_modules() if name.endswith(".mlp.gate")]
    compute_values(model, batch.input_ids, batch.attention_mask)
    for hook in hooks:
        hook.remove()
    config = model.config
    return load_balancing_loss_func(tuple(logits), getattr(config, "num_experts", None) or config.num_local_experts,
                                    config.num_experts_per_tok, batch.attention_mask)


@pytest.mark.parametrize("name", TRAINING_RUNS)
def test_one_update_equals_a_transformers_adamw_step(name, results, checkpoints):
    """With engine.loss.router_aux_coef: the value loss plus the coefficient times the mean of each
    data-parallel rank's forward pass's router loss (one micro-batch per rank here)."""
    _, result = results[name]
    coef = RUNS[name][3].get("router_aux_coef", 0.0)
    model = reference(checkpoints[RUNS[name][1]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0)
    parts = [rollout(rank) for rank in range(result["data_ranks"])]
    cat = {field: torch.cat([getattr(b, field) for b in parts]) for field in
           ("input_ids", "attention_mask", "response_mask", "old_values", "returns")}
    model.train()
    values = shift_to_tokens(compute_values(model, cat["input_ids"], cat["attention_mask"]))
    loss, _ = value_loss(values, cat["old_values"], cat["returns"], cat["response_mask"], clip_range=0.5,
                         agg_mode="token-mean")
    aux = torch.stack([router_loss(model, part) for part in parts]).mean() if coef else None
    objective = loss + coef * aux if coef else loss
    objective.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    metrics = result["metrics"]
    # value_loss is the value loss alone; router_aux_loss (only with the coefficient on) the mean
    # router loss without the coefficient: objective = value_loss + coef * router_aux_loss.
    assert metrics["value_loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    if coef:
        assert metrics["router_aux_loss"] == pytest.approx(float(aux.detach()), abs=1e-5)
    else:
        assert "router_aux_loss" not in metrics
    assert metrics["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    # Every parameter after the step, each expert's included. Adam's first step moves a weight by
    # LR * g / (|g| + eps), LR = 1e-2, about LR * sign(g): a gradient of the wrong sign or routed to the
    # wrong expert moves it 2e-2 the other way. Weights whose gradient is near eps turn rounding into
    # up to 1e-3 (a few of them, 0.1% at most); the rest agree to rounding.
    state = result["state_after"]
    off, total = 0, 0
    for name, param in model.named_parameters():
        diff = (state[name].float() - param.detach()).abs()
        assert diff.max() <= 2e-3, (name, float(diff.max()))
        off, total = off + int((diff > 1e-5).sum()), total + diff.numel()
    assert off <= total // 1000, (off, total)
    model.eval()
    for rank, after in result["values_after"].items():
        batch = rollout(rank)
        with torch.no_grad():
            expected = compute_values(model, batch.input_ids, batch.attention_mask)
        # (looser than before the step: a token whose two best experts the step brought within
        # rounding of each other may route differently)
        assert torch.allclose(after[real(batch)], expected[real(batch)], atol=2e-3), \
            (after[real(batch)] - expected[real(batch)]).abs().max()
        assert not torch.allclose(after, result["values_before"][rank], atol=1e-2)  # it learned


@pytest.mark.parametrize("name", [name for name in TRAINING_RUNS if name.endswith("-aux")])
def test_the_router_loss_reaches_the_gradients(name, results):
    """Against the same run without it: the coefficient changed the gradient (the reference check
    above would also pass for an engine that ignored it only if the router loss had no gradient)."""
    plain = name.removesuffix("-aux")  # the same backend, family and layout
    assert results[name][1]["metrics"]["value_loss"] == pytest.approx(results[plain][1]["metrics"]["value_loss"],
                                                                      abs=1e-6)
    assert abs(results[name][1]["metrics"]["grad_norm"] - results[plain][1]["metrics"]["grad_norm"]) > 1e-3


def test_the_router_loss_is_refused_where_it_cannot_apply():
    from critic_adapters.common.engine.router_aux import aux_experts

    assert aux_experts(0.0, tiny_config("qwen2")) is None
    with pytest.raises(ValueError, match="qwen2 has no router"):
        aux_experts(0.1, tiny_config("qwen2"))
    assert aux_experts(0.1, tiny_config("mixtral")).top_k == 2


def test_a_checkpoint_saved_at_expert_parallel_2_resumes_at_1(results):
    """Model and optimizer state (Adam's moments of every expert) move between expert degrees:
    the resumed engine's values, next update and values after it equal the saving engine's."""
    _, saved = results["megatron-ep2-saves"]
    _, resumed = results["megatron-ep1-resumes"]
    for rank, values in saved["values_after"].items():
        assert torch.allclose(resumed["resumed_values"][rank], values, atol=1e-6)
        assert torch.allclose(resumed["next_values"][rank], saved["next_values"][rank], atol=1e-5)
    for key in ("value_loss", "grad_norm"):
        assert resumed["next_metrics"][key] == pytest.approx(saved["next_metrics"][key], rel=1e-5)
    # The next update moved the weights (else the equalities above would hold for a lost optimizer too).
    assert not torch.allclose(saved["next_values"][0], saved["values_after"][0], atol=1e-4)


def test_the_export_loads_in_plain_transformers_with_the_engines_values(results):
    work, saved = results["megatron-ep2-saves"]
    model = AutoModelForTokenClassification.from_pretrained(work / "hf_export").eval()
    assert type(model).__name__ == "Qwen3MoeForTokenClassification"
    for rank, values in saved["values_after"].items():
        batch = rollout(rank)
        expected = compute_values(model, batch.input_ids, batch.attention_mask)
        assert torch.allclose(values[real(batch)], expected[real(batch)], atol=1e-5)


def _refusal(backend: str, family: str, world: int, **parallel) -> str:
    from critic_adapters.common.engine.registry import check_engine_config, resolve

    config = EngineConfig(model=ModelConfig(path="-"), parallel=ParallelConfig(**parallel))
    with pytest.raises(ValueError) as err:
        check_engine_config(backend, config)
        resolve(backend_spec(backend).check_layout)(tiny_config(family), config, world)
    return str(err.value)


@pytest.mark.parametrize("parallel, world, message", [
    ({"expert": 3}, 3, "engine.parallel.expert=3 must divide the 4 experts"),
    ({"expert": 4}, 2, "engine.parallel.expert=4 must divide the data x context parallel degree (2 of 2"),
    ({"tensor": 2}, 2, "needs engine.parallel.sequence_parallel=true"),
])
def test_megatron_refuses_expert_layouts_it_cannot_run(parallel, world, message):
    assert message in _refusal("megatron", "qwen3_moe", world, **parallel)


@pytest.mark.parametrize("parallel, fewest", [
    ({"expert": 2}, 2), ({"expert": 4, "context": 2}, 4), ({"tensor": 2, "expert": 2}, 4),
    ({"replicate": 2, "expert": 4}, 4), ({"expert": 1}, 1),
])
def test_the_fewest_processes_count_the_expert_degree(parallel, fewest):
    """issue 49: experts are spread over the data x context ranks, so the layout needs that many."""
    assert ParallelConfig(**parallel).min_world_size == fewest


def test_a_dry_run_without_nproc_plans_the_processes_expert_parallelism_needs(tmp_path):
    """issue 49: megatron tensor 1, expert 2 without --nproc plans 2 processes, as the README says."""
    from critic_adapters.common.tests.torchrun import run_launcher_in_process

    dry = run_launcher_in_process("critic_adapters.backends.megatron.train", "--dry-run",
                                  "engine.model.path=embedded:qwen3_moe", "engine.parallel.tensor=1",
                                  "engine.parallel.expert=2", f"trainer.run_dir={tmp_path / 'run'}")
    assert dry.returncode == 0 and "processes: 2 (data parallel 2, experts over 2 ranks)" in dry.stdout, \
        dry.stdout[-2000:] + dry.stderr[-2000:]
    # megatron's count (backends/megatron/memory.py) in the plan: the expert buffer's bytes included
    assert "memory per rank: parameters " in dry.stdout and "activations not estimated" in dry.stdout, dry.stdout


def test_expert_parallelism_is_refused_where_it_cannot_apply():
    assert "qwen2 has no experts" in _refusal("megatron", "qwen2", 2, expert=2)
    assert "engine.parallel.expert=2 (offered by backend=megatron)" in _refusal("fsdp", "qwen3_moe", 2, expert=2)


def test_veomni_refuses_expert_parallelism_saying_why():
    """VeOmni 0.1.12's expert path does not run for this critic (probed on CPU with gloo: the
    experts loop of the transformers backbone VeOmni builds for a token classifier has no token
    dispatch; the dispatching one needs triton): refused by name, with the backend that has it."""
    message = _refusal("veomni", "qwen3_moe", 2, expert=2)
    assert "engine.parallel.expert=2 (offered by backend=megatron; veomni: VeOmni 0.1.12 builds" in message
    assert "needs triton on a GPU" in message


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_veomni_refuses_the_moe_families_it_does_not_model_naming_the_backends_that_do(family):
    from critic_adapters.backends.veomni.value_model import check_family_registered

    with pytest.raises(ValueError, match=f"no modeling for model_type '{family}'.*or use backend=fsdp or "
                                         f"backend=megatron for this family"):
        check_family_registered(tiny_config(family))


def test_lora_on_the_routed_experts_is_refused_saying_why(checkpoints):
    """fsdp / VeOmni: LoRA adapts linear layers; transformers' routed experts are fused tensors."""
    from critic_adapters.common.engine.lora import check_targets

    model = reference(checkpoints["qwen3_moe"])
    with pytest.raises(ValueError, match=r"names \['gate_proj', 'up_proj', 'down_proj'\].*qwen3_moe is a mixture "
                                         r"of experts.*fused \[experts, ...\] tensors"):
        check_targets(model, LoRAConfig(rank=4))  # the default targets include the MLP projections
    check_targets(model, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]))  # attention: taken


def test_megatron_lora_on_experts_is_refused_with_the_backend_that_takes_it():
    from critic_adapters.backends.megatron.config import check_layout

    config = EngineConfig(model=ModelConfig(path="-"), lora=LoRAConfig(rank=4))
    with pytest.raises(ValueError, match="no LoRA for mixture-of-experts critics.*use backend=fsdp"):  # attention
        check_layout(tiny_config("mixtral"), config, 1)


if __name__ == "__main__":
    run_pytest(__file__)
