"""LoRA critics (common/engine/lora.py) checked against what peft itself does: the engine's adapter loads
into plain transformers + peft with no missing or unexpected keys, and one engine update equals an
independent single-process peft step (AdamW over peft's trainable parameters, clip 1.0, the same
clipped value loss over the whole mini-batch)."""

import re

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.common.engine.config import EngineConfig, LoRAConfig, ModelConfig
from critic_adapters.common.engine import shift_to_tokens
from critic_adapters.common.learning.loss import value_loss
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun_group, worker_env
from critic_adapters.common.valuehead import compute_values, load_critic, save_critic
from critic_adapters.tests.conformance.worker import rollout
from critic_adapters.tests.lora_worker import LORA, LR

# name: (backend, processes, engine.parallel of lora_worker: tensor degree, "x" pipeline degree, "sp"
# for sequence parallel)
RUNS = {"fsdp-1": ("fsdp", 1, "1"), "fsdp-2": ("fsdp", 2, "1"), "veomni-1": ("veomni", 1, "1"),
        "veomni-2": ("veomni", 2, "1"), "megatron-1": ("megatron", 1, "1"), "megatron-tp2": ("megatron", 2, "2"),
        "megatron-tp2-sp": ("megatron", 2, "2sp"), "megatron-pp2": ("megatron", 2, "1x2")}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    causal = save_tiny_causal_lm("qwen2", str(root / "causal"))
    base = save_critic(load_critic(causal)[0], str(root / "base"))  # the critic the engine starts from
    return causal, base


_DONE: dict[str, tuple] = {}


def _run_once(name: str, model_dirs, tmp_path_factory, adapter: str | None = None) -> tuple:
    """(data-parallel ranks, workdir, result) of lora_worker run RUNS[name] (once per module): the first
    call for a RUNS entry runs every entry of its process count in one torchrun; a run from an
    adapter (a name not in RUNS: fsdp, one process) runs alone."""
    if name not in _DONE:
        group = ([other for other, (_, n, _) in sorted(RUNS.items()) if n == RUNS[name][1]] if name in RUNS
                 else [name])
        specs = {other: RUNS.get(other, ("fsdp", 1, "1")) for other in group}
        works = run_torchrun_group(specs[name][1], "critic_adapters.tests.lora_worker", group,
                                   lambda other: (specs[other][0], specs[other][2], adapter or "-"), tmp_path_factory,
                                   model_dirs[1], env=worker_env(PYTHONWARNINGS="ignore"))
        for other in group:
            _, ranks, parallel = specs[other]
            tensor, _, pipeline = parallel.removesuffix("sp").partition("x")
            _DONE[other] = (ranks // (int(tensor) * int(pipeline or 1)), works[other],  # a rollout per data-parallel rank
                            torch.load(works[other] / "result.pt"))
    return _DONE[name]


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, model_dirs, tmp_path_factory):
    return _run_once(request.param, model_dirs, tmp_path_factory)


def peft_critic(base_dir: str, adapter_dir: str, *, trainable: bool):
    """plain transformers + peft: the base critic with the adapter, and the adapter keys peft missed
    or did not expect."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    base = AutoModelForTokenClassification.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig.from_pretrained(adapter_dir))
    loaded = set_peft_model_state_dict(model, load_file(f"{adapter_dir}/adapter_model.safetensors"))
    missing = [k for k in loaded.missing_keys if "lora_" in k or "modules_to_save" in k]
    if not trainable:
        model.eval()
    return model, missing, list(loaded.unexpected_keys)


def batches(ranks):
    return [rollout(rank) for rank in range(ranks)]


def test_values_right_after_building_are_the_base_critics(run, model_dirs):
    ranks, work, result = run
    if work.name.startswith("megatron-tp2"):  # (and with sequence parallelism)
        # Measured: at TP 2, freezing linear_qkv's weight alone (no adapter at all, or adapters whose
        # hooks are removed) moves megatron's values by 9e-8; every other frozen weight leaves them
        # exact. Megatron runs a frozen linear through another function (linear_with_frozen_weight).
        assert torch.allclose(result["values_before"], result["values_plain"], rtol=0, atol=1e-6)
    else:
        assert torch.equal(result["values_before"], result["values_plain"])  # B = 0: exactly the engine without LoRA
    base = AutoModelForTokenClassification.from_pretrained(model_dirs[1])  # and, up to the attention path, plain HF
    batch = rollout(0)
    expected = compute_values(base, batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()  # padding positions hold whatever each attention path computes
    assert torch.allclose(result["values_before"][real], expected[real], atol=1e-5)


def test_one_update_equals_a_peft_reference_step(run, model_dirs):
    ranks, work, result = run
    model, missing, unexpected = peft_critic(model_dirs[1], str(work / "adapter_before"), trainable=True)
    assert not missing and not unexpected, (missing, unexpected)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    parts = batches(ranks)
    width = max(b.input_ids.shape[1] for b in parts)
    assert all(b.input_ids.shape[1] == width for b in parts)
    cat = {name: torch.cat([getattr(b, name) for b in parts]) for name in
           ("input_ids", "attention_mask", "response_mask", "old_values", "returns")}
    values = shift_to_tokens(compute_values(model, cat["input_ids"], cat["attention_mask"]))
    loss, _ = value_loss(values, cat["old_values"], cat["returns"], cat["response_mask"], clip_range=0.5,
                         agg_mode="token-mean")
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    metrics = result["metrics"]
    assert metrics["value_loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    model.eval()
    batch = rollout(0)
    with torch.no_grad():
        after = compute_values(model, batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()
    assert torch.allclose(result["values_after"][real], after[real], atol=2e-4), \
        (result["values_after"][real] - after[real]).abs().max()


def test_only_the_adapters_and_the_head_train(run):
    _, _, result = run
    trainable = set(result["trainable_all"])  # the engine's own names, of every pipeline stage
    if any(n.startswith("module.") for n in trainable):  # megatron: <linear>_lora.lora_A_<part>, output_layer.*
        assert all("_lora.lora_" in n or n.startswith("module.output_layer.") for n in trainable), trainable
        assert {"module.output_layer.weight", "module.output_layer.bias"} <= trainable
    else:
        assert trainable and all(".lora_A." in n or ".lora_B." in n or n.startswith("score.") for n in trainable)
        assert {"score.weight", "score.bias"} <= trainable
    assert result["optimized"] == len(result["trainable"])  # rank 0's optimizer, rank 0's parameters
    assert any(".lora_A." in name for name in result["before"])
    for name, before in result["before"].items():  # HF names on every backend
        changed = not torch.equal(before, result["after"][name])
        # lora_A is not changed by the first step: its gradient is B^T (...) with B = 0.
        expected = ".lora_B." in name or name.startswith("score.")
        assert changed == expected, f"{name} changed={changed}"
    trainable_count, total = result["counts"]
    assert 0 < trainable_count < total


def test_the_plan_counts_a_lora_critics_bytes_exactly(run):
    """The job plan's parameter and optimizer bytes (common.engine.memory: the frozen base, the adapters,
    AdamW's state of the adapters and the head; megatron's padded DDP buffer of the adapters and the head,
    and its distributed optimizer's shards of them) equal rank 0's resident_bytes() after the step."""
    _, _, result = run
    memory = result["memory"]
    params, _, optimizer = memory["planned"]
    assert (params, optimizer) == (memory["resident"]["model"], memory["resident"]["optimizer"]), memory


def test_the_exports_load_cleanly_with_the_engines_values(run, model_dirs):
    _, work, result = run
    batch = rollout(0)
    real = batch.attention_mask.bool()  # padding positions hold whatever each attention path computes
    engine_values = result["values_after"][real]
    merged, info = AutoModelForTokenClassification.from_pretrained(str(work / "hf_export"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = compute_values(merged, batch.input_ids, batch.attention_mask)[real]
    assert torch.allclose(got, engine_values, atol=1e-5), (got - engine_values).abs().max()
    model, missing, unexpected = peft_critic(model_dirs[1], str(work / "adapter_after"), trainable=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        got = compute_values(model, batch.input_ids, batch.attention_mask)[real]
    assert torch.allclose(got, engine_values, atol=1e-5)
    # ... and through our own loader (load_critic(adapter_path=), what `convert --adapter` uses).
    ours, report = load_critic(model_dirs[1], adapter_path=str(work / "adapter_after"))
    got = compute_values(ours, batch.input_ids, batch.attention_mask)[real]
    assert torch.allclose(got, engine_values, atol=1e-5) and report.head == "loaded"


def test_a_checkpoint_holds_only_what_trains_and_resumes_bit_identically(run):
    _, work, result = run
    assert result["extra"] == {"step": 1}
    (next_metrics, next_values), (resumed_metrics, resumed_values) = result["next"], result["resumed"]
    assert torch.equal(next_values, resumed_values)
    for key in ("value_loss", "grad_norm", "explained_variance"):
        assert next_metrics[key] == resumed_metrics[key], key
    import torch.distributed.checkpoint as dcp

    saved = set(dcp.FileSystemReader(str(work / "checkpoint")).read_metadata().state_dict_metadata)
    if (work / "checkpoint" / "common.pt").exists():  # megatron's dist_checkpointing: layers stacked, no prefix
        model_keys = {key for key in saved if not key.startswith("optimizer.")}
        trainable = {re.sub(r"^module\.|(?<=layers)\.\d+", "", name) for name in result["trainable_all"]}
    else:
        model_keys = {key.removeprefix("model.") for key in saved if key.startswith("model.")}
        trainable = set(result["trainable_all"])
    assert model_keys == trainable  # no frozen base weight is saved again
    full = sum(t.numel() * 4 for t in result["before"].values())
    trained = sum(t.numel() * 4 for name, t in result["before"].items()
                  if ".lora_" in name or name.startswith("score."))
    written = result["checkpoint_bytes"] - 2**20  # checkpoint_bytes adds 1 MiB of slack
    # the adapters, the head, their Adam moments (and megatron's distributed optimizer's fp32 copy of them)
    copies = 4 if (work / "checkpoint" / "common.pt").exists() else 3
    assert copies * trained <= written < copies * trained + 4096 and written < full


def test_a_megatron_tp2_adapter_continues_on_fsdp_with_the_same_values(model_dirs, tmp_path_factory):
    _, megatron_work, megatron = _run_once("megatron-tp2", model_dirs, tmp_path_factory)
    # An FSDP engine started from the megatron adapter (engine.lora.adapter_path) has its values, and
    # its next step is an ordinary LoRA step (the run's other checks hold for it too).
    _, _, fsdp = _run_once("fsdp-from-megatron", model_dirs, tmp_path_factory,
                           str(megatron_work / "adapter_after"))
    real = rollout(0).attention_mask.bool()
    assert torch.allclose(fsdp["values_before"][real], megatron["values_after"][real], atol=1e-5), \
        (fsdp["values_before"][real] - megatron["values_after"][real]).abs().max()
    assert not torch.allclose(fsdp["values_before"][real], fsdp["values_plain"][real], atol=1e-3)  # it did load
    for name, tensor in megatron["after"].items():  # the adapter and head it trained, in peft's names
        if ".lora_" in name or name.startswith("score."):
            assert torch.equal(fsdp["before"][name], tensor), name


def test_the_fingerprint_names_the_lora_settings(run):
    _, _, result = run
    assert result["fingerprint"]["transforms"] == ["lora(rank=4, alpha=8, targets=q_proj,k_proj,v_proj,o_proj,"
                                                   "gate_proj,up_proj,down_proj)"]


def test_bad_lora_settings_are_one_line_before_anything_is_built(model_dirs, tmp_path):
    from critic_adapters.common.engine.config import load_train_config
    from critic_adapters.common.engine.registry import check_layout

    with pytest.raises(ValueError, match=r"engine.lora.rank=-1 must be >= 0"):
        load_train_config([], ["engine.lora.rank=-1"])
    engine = EngineConfig(model=ModelConfig(path=model_dirs[1]), lora=LoRAConfig(rank=4, target_modules=["c_attn"]))
    for backend in ("fsdp", "megatron", "veomni"):
        with pytest.raises(ValueError, match=r"engine.lora.target_modules names \['c_attn'\], which qwen2 does not have"):
            check_layout(backend, engine, 1)
    engine = EngineConfig(model=ModelConfig(path=model_dirs[1]), lora=LoRAConfig(rank=4, target_modules=["score"]))
    with pytest.raises(ValueError, match=r"names \['score'\]: the megatron backend adapts only q_proj, "):
        check_layout("megatron", engine, 1)
    # An adapter trained on another base (other shapes) is refused before any process group exists.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dirs[1])
    config.intermediate_size = 96
    other = get_peft_model(AutoModelForTokenClassification.from_config(config),
                           LoraConfig(r=4, lora_alpha=8.0, target_modules=list(LORA.target_modules),
                                      modules_to_save=["score"]))
    other.save_pretrained(str(tmp_path / "other_adapter"))
    engine = EngineConfig(model=ModelConfig(path=model_dirs[1]),
                          lora=LoRAConfig(rank=4, alpha=8.0, adapter_path=str(tmp_path / "other_adapter")))
    with pytest.raises(ValueError, match=r"does not fit qwen2 at engine.model.path \(shapes differ: "
                                         r"base_model\.model\.model\.layers\.0\.mlp\.\w+_proj\.lora_\w\.weight "
                                         r"\((96, 4|4, 96)\) \(this critic: \((128, 4|4, 128)\)\)"):
        check_layout("fsdp", engine, 1)
    engine = EngineConfig(model=ModelConfig(path=model_dirs[1]),
                          lora=LoRAConfig(rank=8, adapter_path=str(tmp_path / "other_adapter")))
    with pytest.raises(ValueError, match=r"trained with other LoRA settings \(rank: 4 in the adapter, 8 in engine.lora"):
        check_layout("fsdp", engine, 1)


if __name__ == "__main__":
    run_pytest(__file__)
