"""Write tiny critic checkpoints in every format load_critic reads, plus a reference value function.

Each builder returns (path, reference) where reference(input_ids, attention_mask) -> [B, T] values
computed by the *original* library: trl's own value output for trl checkpoints, transformers'
own modules for the rest. Tests compare load_critic + compute_values against it.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

from critic_adapters.common.testdata import tiny_causal_lm, tiny_config
from critic_adapters.common.valuehead._quiet import quiet_transformers
from critic_adapters.common.valuehead.trl_compat import SUPPORTED_TRL, installed_trl_version, trl_value_head_class

VOCAB = 1000



def trl_class_or_skip() -> type:
    """trl's value-head class, or skip the test naming the installed trl (trl >= 1.13 has none)."""
    cls = trl_value_head_class()
    if cls is None:
        import pytest

        pytest.skip(f"needs trl's value-head class ({SUPPORTED_TRL}); installed: trl {installed_trl_version()}")
    return cls

def _seeded_head(hidden: int, seed: int, bias: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = {"weight": torch.randn(1, hidden, generator=g) * 0.5}
    if bias:
        head["bias"] = torch.randn(1, generator=g)
    return head


def _write_config(path: str, **updates) -> None:
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(updates)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)


def _backbone_reference(path: str, head: dict[str, torch.Tensor]):
    """transformers' own AutoModel backbone of `path`, then the head: what OpenRLHF/Megatron compute."""
    with quiet_transformers():
        backbone = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()

    def reference(ids, mask):
        hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        out = hidden @ head["weight"].T
        if "bias" in head:
            out = out + head["bias"]
        return out.squeeze(-1)

    return reference


def _save(model, path: str, **kwargs) -> None:
    with quiet_transformers():
        model.save_pretrained(path, **kwargs)


def causal_lm(root: str, family: str = "qwen2"):
    """Plain causal LM (fresh head): the reference is its final hidden state times our fresh head."""
    path = os.path.join(root, f"{family}-clm")
    model = tiny_causal_lm(family)
    _save(model, path)

    def hidden_states(ids, mask):
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]

    return path, hidden_states


def trl_value_head(root: str, *, storage: str = "single-file"):
    """trl AutoModelForCausalLMWithValueHead written by trl's own save_pretrained."""
    cls = trl_class_or_skip()
    wrapper = cls.from_pretrained(tiny_causal_lm("qwen2"), summary_dropout_prob=0.0)
    with torch.no_grad():
        for name, tensor in _seeded_head(64, seed=1).items():
            getattr(wrapper.v_head.summary, name).copy_(tensor)
    wrapper.eval()
    path = os.path.join(root, f"trl-{storage}")
    kwargs = {"max_shard_size": "200KB"} if storage == "sharded" else {}
    with quiet_transformers():
        wrapper.save_pretrained(path, **kwargs)

    def reference(ids, mask):
        return wrapper(input_ids=ids, attention_mask=mask)[2]

    return path, reference


def trl_sidecar(root: str, *, suffix: str = "safetensors"):
    """A base causal LM plus value_head.safetensors / value_head.bin (LLaMA-Factory, ROLL)."""
    cls = trl_class_or_skip()
    base = tiny_causal_lm("qwen2")
    path = os.path.join(root, f"trl-sidecar-{suffix}")
    _save(base, path)
    head = _seeded_head(64, seed=2)
    sidecar = {f"v_head.summary.{k}": v.contiguous() for k, v in head.items()}
    if suffix == "safetensors":
        save_file(sidecar, os.path.join(path, "value_head.safetensors"))
    else:
        torch.save(sidecar, os.path.join(path, "value_head.bin"))
    wrapper = cls.from_pretrained(base, summary_dropout_prob=0.0)
    with torch.no_grad():
        wrapper.v_head.summary.weight.copy_(head["weight"])
        wrapper.v_head.summary.bias.copy_(head["bias"])
    wrapper.eval()
    return path, lambda ids, mask: wrapper(input_ids=ids, attention_mask=mask)[2]


def trl_patched_state_dict(root: str):
    """verl's patched trl wrapper: nn.Module.state_dict() -> pretrained_model.* + v_head.summary.*."""
    cls = trl_class_or_skip()
    wrapper = cls.from_pretrained(tiny_causal_lm("qwen2"), summary_dropout_prob=0.0).eval()
    with torch.no_grad():
        for name, tensor in _seeded_head(64, seed=3).items():
            getattr(wrapper.v_head.summary, name).copy_(tensor)
    path = os.path.join(root, "trl-patched")
    os.makedirs(path)
    wrapper.pretrained_model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in torch.nn.Module.state_dict(wrapper).items()}
    save_file(state, os.path.join(path, "model.safetensors"))
    return path, lambda ids, mask: wrapper(input_ids=ids, attention_mask=mask)[2]


def token_classification(root: str, *, label_as_causal_lm: bool = False, family: str = "qwen2"):
    """HF *ForTokenClassification(num_labels=1); optionally mislabelled CausalLM, as verl exports it."""
    config = tiny_config(family)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    torch.manual_seed(4)
    model = AutoModelForTokenClassification.from_config(config).eval()
    with torch.no_grad():
        # gpt_neox (like gpt2, bloom) names its token-classification head `classifier`.
        (model.classifier if family == "gpt_neox" else model.score).bias.fill_(0.3)
    path = os.path.join(root, f"tokcls-{family}{'-as-clm' if label_as_causal_lm else ''}")
    _save(model, path)
    if label_as_causal_lm:
        _write_config(path, architectures=[type(model).__name__.replace("TokenClassification", "CausalLM")])
    return path, lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)


def _decisive_experts(model, seed: int) -> None:
    """Router weights N(0, 1) (no near-ties between experts, which any two implementations could break
    differently) and expert weights N(0, 0.1) (experts that matter to the values)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=g))
            elif ".mlp.experts." in name or ".shared_expert" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def moe_token_classification(root: str, family: str, seed: int = 4):
    """A mixture-of-experts *ForTokenClassification(num_labels=1) written by transformers, with
    decisive routing and experts that matter (_decisive_experts)."""
    config = tiny_config(family)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(config).eval()
    _decisive_experts(model, seed)
    with torch.no_grad():
        model.score.bias.fill_(0.3)
    path = os.path.join(root, f"moe-{family}")
    _save(model, path)
    return path, lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)


def moe_trl(root: str, family: str, *, sidecar: bool = False, seed: int = 5):
    """A mixture-of-experts causal LM with a trl value head: written by trl's own save_pretrained
    (inline `v_head.summary.*`), or as the base model plus value_head.safetensors (sidecar)."""
    base = tiny_causal_lm(family, seed)
    _decisive_experts(base, seed)
    wrapper = trl_class_or_skip().from_pretrained(base, summary_dropout_prob=0.0)
    # values of the returns' size (|v| ~ 1): a head that puts them at 10 makes the first update's loss
    # large and its clipped gradients tiny, where Adam's eps turns rounding into visible differences
    head = {name: tensor * 0.1 for name, tensor in _seeded_head(base.config.hidden_size, seed=seed).items()}
    with torch.no_grad():
        for name, tensor in head.items():
            getattr(wrapper.v_head.summary, name).copy_(tensor)
    path = os.path.join(root, f"moe-trl-{'sidecar-' if sidecar else ''}{family}")
    if sidecar:
        _save(base, path)
        save_file({f"v_head.summary.{k}": v.contiguous() for k, v in head.items()},
                  os.path.join(path, "value_head.safetensors"))
    else:
        _save(wrapper, path)
    wrapper.eval()
    return path, lambda ids, mask: wrapper(input_ids=ids, attention_mask=mask)[2]


def sequence_classification(root: str):
    """HF *ForSequenceClassification reward model (score.weight, no bias), applied per token."""
    config = tiny_config("qwen2")
    config.num_labels = 1
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    path = os.path.join(root, "seqcls")
    _save(model, path)

    def reference(ids, mask):
        return model.score(model.model(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)

    return path, reference


def _backbone_with_head(root: str, name: str, head_keys: dict[str, str], head: dict[str, torch.Tensor],
                        **config_updates):
    """Save a tiny causal LM, drop its lm_head, add head tensors under the given names."""
    path = os.path.join(root, name)
    _save(tiny_causal_lm("qwen2"), path)
    weights = os.path.join(path, "model.safetensors")
    from safetensors.torch import load_file

    state = {k: v for k, v in load_file(weights).items() if not k.startswith("lm_head.")}
    state.update({key: head[part].contiguous() for part, key in head_keys.items()})
    save_file(state, weights, metadata={"format": "pt"})
    if config_updates:
        _write_config(path, **config_updates)
    return path, _backbone_reference(path, head)


def openrlhf(root: str, prefix: str = "value_head"):
    head = _seeded_head(64, seed=6, bias=False)
    return _backbone_with_head(root, f"openrlhf-{prefix}", {"weight": f"{prefix}.weight"}, head,
                               value_head_prefix=prefix, normalize_reward=False)


def megatron_export(root: str, *, with_bias: bool = False):
    """Megatron critic exported to HF: lm_head.weight is [1, H] (slime also writes lm_head.bias)."""
    head = _seeded_head(64, seed=7, bias=with_bias)
    keys = {"weight": "lm_head.weight", **({"bias": "lm_head.bias"} if with_bias else {})}
    return _backbone_with_head(root, f"megatron{'-bias' if with_bias else ''}", keys, head)


def verl_legacy(root: str):
    head = _seeded_head(64, seed=8)
    return _backbone_with_head(root, "verl-legacy", {"weight": "lm_head.0.weight", "bias": "lm_head.0.bias"}, head)


def unknown_head_name(root: str):
    """A head stored under a name no format uses: must be an error, never a silent re-init."""
    head = _seeded_head(64, seed=9)
    return _backbone_with_head(root, "mystery-head", {"weight": "critic_head.weight", "bias": "critic_head.bias"}, head)


def base_model(root: str):
    """A bare backbone (AutoModel.save_pretrained: no `model.` prefix, no head at all)."""
    path = os.path.join(root, "base-model")
    torch.manual_seed(10)
    backbone = AutoModel.from_config(tiny_config("qwen2")).eval()
    _save(backbone, path)

    def hidden_states(ids, mask):
        return backbone(input_ids=ids, attention_mask=mask).last_hidden_state

    return path, hidden_states
