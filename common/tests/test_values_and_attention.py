"""compute_values on packed rows, dtypes; attention implementation selection."""

import pytest
import torch

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic, select_attn_implementation
from critic_adapters.common.valuehead import attention
from critic_adapters.common.valuehead.config import critic_class, critic_config
from critic_adapters.common.testdata import tiny_config


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    path, _ = build.trl_value_head(str(tmp_path_factory.mktemp("trl")))
    return load_critic(path)[0]


def test_packed_rows_equal_separate_sequences(critic):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7]
    seqs = [torch.randint(3, 990, (n,), generator=g) for n in lengths]
    packed_ids = torch.cat(seqs)[None]  # (1, 15)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = compute_values(critic, packed_ids, None, position_ids=position_ids)[0]
        separate = torch.cat([compute_values(critic, s[None], torch.ones(1, len(s), dtype=torch.long))[0] for s in seqs])
        # Without the position ids the sequences would attend to each other: a check that can fail.
        mixed = compute_values(critic, packed_ids, torch.ones_like(packed_ids))[0]
    assert torch.allclose(packed, separate, atol=1e-5)
    assert not torch.allclose(mixed, separate, atol=1e-3)


@pytest.mark.parametrize("head_class", ["sequence", "causal-lm"])
def test_models_that_are_not_per_token_critics_are_refused(head_class):
    # A SequenceClassification model gives [B, 1]: compute_values once squeezed it to [B] silently.
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = tiny_config("qwen2")
    if head_class == "sequence":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config).eval()
    else:
        model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 990, (2, 5))
    with pytest.raises(ValueError, match=r"per-token critic returns \[B, T, 1\].*load_critic"):
        compute_values(model, ids, torch.ones_like(ids))


def test_packed_rows_refuse_a_padding_mask(critic):
    ids = torch.randint(3, 990, (1, 6))
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    with pytest.raises(ValueError, match="packed rows"):
        compute_values(critic, ids, mask, position_ids=position_ids)


def test_bf16_model_gives_float32_values(tmp_path):
    path, reference = build.trl_value_head(str(tmp_path))
    model, _ = load_critic(path, torch_dtype=torch.bfloat16)
    ids = torch.randint(3, 990, (2, 6))
    with torch.no_grad():
        values = compute_values(model, ids, torch.ones_like(ids))
        expected = reference(ids, torch.ones_like(ids))
    assert values.dtype == torch.float32
    assert torch.allclose(values, expected, atol=0.1)  # bf16 weights: close, not equal


def _cls(family):
    return critic_class(critic_config(tiny_config(family)))


def test_attention_selection(monkeypatch):
    """Issue 41, item 1: load_critic on a GPU with flash_attn installed picked flash_attention_2 for
    an fp32 critic, which crashes at the first forward: flash only for bf16/fp16 parameters."""
    from critic_adapters.common.parallel import kernels

    nothing = kernels.Installed(cuda=False, flash_attn=False, torch_varlen=False, transformer_engine=False,
                                liger_kernel=False)
    monkeypatch.setattr(kernels, "installed", lambda: nothing)
    assert select_attn_implementation(_cls("qwen2")) == "sdpa"
    # Gemma2 refuses sdpa where this transformers' class says so (5.22; 5.9 allows it)
    assert select_attn_implementation(_cls("gemma2")) == ("sdpa" if _cls("gemma2")._supports_sdpa else "eager")
    assert select_attn_implementation(_cls("qwen2"), "eager") == "eager"  # explicit wins
    gpu = kernels.Installed(cuda=True, flash_attn=True, torch_varlen=True, transformer_engine=False,
                            liger_kernel=False)
    monkeypatch.setattr(kernels, "installed", lambda: gpu)
    assert select_attn_implementation(_cls("qwen2")) == "sdpa"  # fp32 parameters
    assert select_attn_implementation(_cls("qwen2"), dtype=torch.bfloat16) == "flash_attention_2"
    assert select_attn_implementation(_cls("qwen2"), "sdpa", torch.bfloat16) == "sdpa"


def test_flash_attention_needs_both_the_package_and_cuda(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else find_spec(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert attention.flash_attention_available() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attention.flash_attention_available() is True
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_attn" else find_spec(name))
    assert attention.flash_attention_available() is False


def test_loader_uses_the_selected_implementation(tmp_path):
    path, _ = build.causal_lm(str(tmp_path), "gemma2")
    _, report = load_critic(path)
    # what this transformers' Gemma2 class allows: eager where it refuses sdpa (5.22), else sdpa (5.9)
    assert report.attn_implementation == ("sdpa" if _cls("gemma2")._supports_sdpa else "eager")
    path, _ = build.causal_lm(str(tmp_path), "qwen2")
    assert load_critic(path)[1].attn_implementation == "sdpa"
    assert load_critic(path, attn_implementation="eager")[1].attn_implementation == "eager"


if __name__ == "__main__":
    run_pytest(__file__)
