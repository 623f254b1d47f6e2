"""load_critic + compute_values equal the original library's values for every checkpoint format."""

import pytest
import torch

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import assert_close_on_mask, padded_batch, run_pytest, vocab_projection_watch
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead.config import critic_head

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


if __name__ == "__main__":
    run_pytest(__file__)
