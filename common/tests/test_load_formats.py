"""load_critic + compute_values equal the original library's values for every checkpoint format."""

import dataclasses
import os

import pytest
import torch

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import assert_close_on_mask, padded_batch, run_pytest, vocab_projection_watch
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead.config import critic_head
from critic_adapters.common.valuehead.errors import CriticLoadError
from critic_adapters.common.valuehead.sliced import open_sliced
from critic_adapters.common.learning.hl_gauss import HLGaussSupport

ATOL = 2e-5

# builder, expected report.format, expected report.head, expected report.bias, expected storage
WITH_HEAD = [
    (build.trl_value_head, {}, "trl-value-head", "loaded", "single-file"),
    (build.trl_value_head, {"storage": "sharded"}, "trl-value-head", "loaded", "sharded"),
    (build.trl_sidecar, {"suffix": "safetensors"}, "trl-value-head", "loaded", "sidecar"),
    (build.trl_sidecar, {"suffix": "bin"}, "trl-value-head", "loaded", "sidecar"),
    (build.trl_patched_state_dict, {}, "trl-value-head", "loaded", "single-file"),
    (build.token_classification, {}, "hf-token-classification", "loaded", "single-file"),
    (build.token_classification, {"label_as_causal_lm": True}, "hf-token-classification", "loaded", "single-file"),
    (build.sequence_classification, {}, "hf-sequence-classification", "zero", "single-file"),
    (build.openrlhf, {}, "openrlhf", "zero", "single-file"),
    (build.openrlhf, {"prefix": "score"}, "openrlhf", "zero", "single-file"),
    (build.megatron_export, {}, "megatron-export", "zero", "single-file"),
    (build.megatron_export, {"with_bias": True}, "megatron-export", "loaded", "single-file"),
    (build.verl_legacy, {}, "verl-legacy-critic", "loaded", "single-file"),
]


@pytest.mark.parametrize("builder,kwargs,fmt,bias,storage", WITH_HEAD,
                         ids=[f"{b.__name__}{'-' + '-'.join(map(str, k.values())) if k else ''}" for b, k, *_ in WITH_HEAD])
def test_values_match_original_library(tmp_path, builder, kwargs, fmt, bias, storage):
    path, reference = builder(str(tmp_path), **kwargs)
    model, report = load_critic(path)
    assert (report.format, report.head, report.bias, report.storage) == (fmt, "loaded", bias, storage)
    ids, mask = padded_batch()
    with torch.no_grad(), vocab_projection_watch(model) as calls:
        values = compute_values(model, ids, mask)
        expected = reference(ids, mask)
    assert calls == [], f"vocab projection called: {calls}"
    assert values.shape == ids.shape and values.dtype == torch.float32
    assert_close_on_mask(values, expected, mask, ATOL)


@pytest.mark.parametrize("builder", [build.causal_lm, build.base_model])
def test_headless_checkpoints_get_a_fresh_seeded_head(tmp_path, builder):
    path, hidden_states = builder(str(tmp_path))
    model, report = load_critic(path)
    assert report.head == "initialized" and report.head_source == []
    assert report.format == ("causal-lm" if builder is build.causal_lm else "base-model")
    assert set(report.missing_keys) == {"score.weight", "score.bias"}
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = (hidden_states(ids, mask) @ critic_head(model).weight.T + critic_head(model).bias).squeeze(-1)
        assert_close_on_mask(compute_values(model, ids, mask), expected, mask, ATOL)
    # Same seed -> same head on every rank and run; another seed -> another head.
    again, _ = load_critic(path)
    other, _ = load_critic(path, head_init_seed=1)
    assert torch.equal(critic_head(again).weight, critic_head(model).weight)
    assert not torch.equal(critic_head(other).weight, critic_head(model).weight)
    assert float(critic_head(model).weight.detach().std()) == pytest.approx(0.02, rel=0.3)


FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "gemma2", "phi3", "qwen2_moe", "deepseek_v3", "gemma3_text",
            "qwen2_vl", "gpt_neox"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_its_causal_lm_backbone(tmp_path, family):
    path, hidden_states = build.causal_lm(str(tmp_path), family)
    model, report = load_critic(path)
    assert report.family == family and report.head == "initialized"
    assert not any(name.endswith("lm_head") for name, _ in model.named_modules())
    ids, mask = padded_batch()
    with torch.no_grad(), vocab_projection_watch(model) as calls:
        values = compute_values(model, ids, mask)
        expected = (hidden_states(ids, mask) @ critic_head(model).weight.T + critic_head(model).bias).squeeze(-1)
    assert calls == []
    assert_close_on_mask(values, expected, mask, ATOL, what=f"{family} values")


def test_verl_export_labelled_causal_lm_is_relabelled(tmp_path):
    path, _ = build.token_classification(str(tmp_path), label_as_causal_lm=True)
    model, _ = load_critic(path)
    assert model.config.architectures == ["Qwen2ForTokenClassification"]
    assert model.config.num_labels == 1


def test_fresh_head_on_request_ignores_the_checkpoint_head(tmp_path):
    path, reference = build.trl_value_head(str(tmp_path))
    model, report = load_critic(path, fresh_head=True)
    assert report.head == "initialized" and report.format == "trl-value-head"
    assert "v_head.summary.weight" in report.unexpected_keys
    ids, mask = padded_batch()
    with torch.no_grad():
        assert not torch.allclose(compute_values(model, ids, mask), reference(ids, mask))


# -- the same critic, read one slice at a time (common/valuehead/sliced.py) -------------------------
SLICED_CASES = [(b, k, {}) for b, k, *_ in WITH_HEAD] + [
    (build.causal_lm, {}, {}), (build.base_model, {}, {}),
    (build.token_classification, {}, {"fresh_head": True, "head_init_seed": 3}),
    (build.trl_sidecar, {"suffix": "safetensors"}, {"fresh_head": True}),
    (build.token_classification, {}, {"value_head": HLGaussSupport(7, -1.0, 1.0, 0.75)}),
    (build.trl_value_head, {}, {"value_head": HLGaussSupport(7, -1.0, 1.0, 0.75), "init_from_scalar_head": True}),
    (build.trl_sidecar, {"suffix": "safetensors"}, {"value_head": HLGaussSupport(5, -1.0, 1.0, 0.75),
                                                    "init_from_scalar_head": True}),
    # Mixture of experts: per-expert tensors on disk, stacked by transformers as it loads.
    *[(build.moe_token_classification, {"family": family}, {}) for family in ("mixtral", "qwen2_moe", "qwen3_moe")],
    (build.causal_lm, {"family": "qwen2_moe"}, {}),
]


@pytest.mark.parametrize("builder,kwargs,options", SLICED_CASES,
                         ids=[f"{b.__name__}-{'-'.join(map(str, k.values()))}-{'-'.join(o)}" for b, k, o in SLICED_CASES])
def test_a_sliced_read_is_what_load_critic_loads(tmp_path, builder, kwargs, options):
    """open_sliced decides what load_critic decides (report, head) from headers alone, and every
    row range it reads equals load_critic's tensor."""
    path, _ = builder(str(tmp_path), **kwargs)
    sliced = open_sliced(path, **options)
    model, report = load_critic(path, **options)
    assert not isinstance(sliced, str), sliced
    assert dataclasses.asdict(sliced.report) == dataclasses.asdict(report)
    state = model.state_dict()
    assert set(sliced.shapes) == set(state)
    for name, tensor in state.items():
        assert torch.equal(sliced.read(name), tensor), name
        rows = tensor.shape[0] if tensor.dim() else 1
        if tensor.dim() and rows > 1:
            assert torch.equal(sliced.read(name, (1, rows)), tensor[1:]), name


def test_a_sliced_read_of_fused_experts_on_disk(tmp_path):
    """The export writes transformers' in-memory form (one [experts, ...] tensor per layer and
    projection), which transformers loads as it is: read the same way."""
    from critic_adapters.common.valuehead import save_critic

    path, _ = build.moe_token_classification(str(tmp_path), "qwen3_moe")
    model, _ = load_critic(path)
    fused = save_critic(model, str(tmp_path / "fused"))
    sliced = open_sliced(fused)
    assert not isinstance(sliced, str), sliced
    for name, tensor in model.state_dict().items():
        assert torch.equal(sliced.read(name), tensor), name
    experts = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(sliced.read("model.layers.1.mlp.experts.gate_up_proj", (2, 4)), experts[2:4])


def test_a_sliced_read_refuses_what_load_critic_refuses(tmp_path):
    """A corrupt tensor and an unknown head name fail as load_critic fails (or go to it to fail);
    .bin weights and an incomplete set of experts go to load_critic whole."""
    path, _ = build.token_classification(str(tmp_path / "bin"))
    model, _ = load_critic(path)
    torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    os.remove(os.path.join(path, "model.safetensors"))
    assert "not safetensors (pytorch_model.bin)" in open_sliced(path)
    path, _ = build.causal_lm(str(tmp_path / "moe"), "qwen2_moe")
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    assert "experts are incomplete" in open_sliced(path)
    path, _ = build.unknown_head_name(str(tmp_path / "unknown"))
    assert "does not use" in open_sliced(path)
    path, _ = build.token_classification(str(tmp_path / "nan"))
    model, _ = load_critic(path)
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    model.save_pretrained(path)
    with pytest.raises(CriticLoadError, match="model.norm.weight holds 1 NaN"):
        open_sliced(path).read("model.norm.weight", (0, 8))


if __name__ == "__main__":
    run_pytest(__file__)
