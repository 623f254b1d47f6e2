"""The config override that turns any supported HF config into a per-token critic config.

A critic is `*ForTokenClassification(num_labels=1)`: no vocab projection at all. Families that
transformers gives no such class (VLMs, gemma3_text, ...) get the same layout through
`GenericForTokenClassification` over the family's `AutoModel` backbone.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.modeling_layers import GenericForTokenClassification

from ..learning.hl_gauss import CONFIG_KEY, HLGaussHead, HLGaussSupport, support_of

# Written as `architectures` for families without a TokenClassification class: the weights are
# exactly what transformers' GenericForTokenClassification mixin lays out (model.* + score.*).
GENERIC_ARCHITECTURE = "GenericForTokenClassification"

# Floats on purpose: verl wrote hidden_dropout="0" (a string), which nn.Dropout and the typed
# configs of gpt_neox/falcon/bloom reject.
_ZERO_DROPOUTS = ("classifier_dropout", "hidden_dropout", "summary_dropout_prob")

_GENERIC_CLASSES: dict[type, type] = {}
_HEAD_NAMES: dict[type, str] = {}
_SCORE_ALIASED: dict[type, type] = {}


def has_token_classification_class(config: PretrainedConfig) -> bool:
    return type(config) in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING


def _generic_critic_class(config: PretrainedConfig) -> type:
    """A `GenericForTokenClassification` over the family's AutoModel backbone (cached per family)."""
    config_type = type(config)
    if config_type not in _GENERIC_CLASSES:
        backbone = MODEL_MAPPING[config_type]
        family_base = next(
            base for base in backbone.__mro__[1:]
            if issubclass(base, PreTrainedModel) and base is not PreTrainedModel
        )
        name = backbone.__name__.removesuffix("Model") + "CriticForTokenClassification"
        _GENERIC_CLASSES[config_type] = type(
            name, (GenericForTokenClassification, family_base),
            {"config_class": config_type, "__module__": __name__},
        )
        # Read (and write) the backbone under the same key names as the family's own causal-LM/VLM
        # checkpoints, e.g. Qwen2-VL's `visual.*` / `model.layers.*`, by reusing its key conversions.
        for full_mapping in (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING):
            if config_type in full_mapping:
                conversions = get_checkpoint_conversion_mapping(full_mapping[config_type].__name__)
                if conversions:
                    register_checkpoint_conversion_mapping(name, conversions, overwrite=True)
                break
    return _GENERIC_CLASSES[config_type]


def _architecture_class(config: PretrainedConfig) -> type:
    """transformers' own per-token class for this config (or our generic one)."""
    if has_token_classification_class(config):
        return MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(config)]
    if type(config) in MODEL_MAPPING:
        return _generic_critic_class(config)
    raise ValueError(
        f"model_type {config.model_type!r} ({type(config).__name__}) has no critic form: transformers "
        f"has neither a *ForTokenClassification class nor an AutoModel backbone for it. Use a model "
        f"family transformers supports, or pass trust_remote_code=True if the checkpoint ships its own code."
    )


def _with_score_alias(cls: type) -> type:
    """`cls` plus a read-only `score` property for its `classifier` head (cached per class).

    trl's PPOTrainer (and code written after it) reads a value model's head as `.score`; gpt2,
    gpt_neox, bloom and falcon name it `classifier`. A property adds no parameter, so state dicts,
    saved keys and the class name stay exactly transformers' own.
    """
    if cls not in _SCORE_ALIASED:
        _SCORE_ALIASED[cls] = type(cls.__name__, (cls,), {
            "__module__": __name__,
            "__doc__": f"{cls.__name__} whose `classifier` head is also reachable as `score` (trl's name).",
            "score": property(lambda self: self.classifier, doc="The scalar head (alias of `classifier`)."),
        })
    return _SCORE_ALIASED[cls]


def critic_class(config: PretrainedConfig) -> type:
    """The model class a critic of this config is built with; its head is reachable as `.score`."""
    cls = _architecture_class(config)
    return _with_score_alias(cls) if head_name(config) == "classifier" else cls


def head_name(config: PretrainedConfig) -> str:
    """Attribute name of the critic's [1, H] head: `score` for most families, `classifier` for some
    (gpt2, gpt_neox, bloom). Found on a meta-device instance, so nothing is allocated."""
    cls = _architecture_class(config)
    if cls not in _HEAD_NAMES:
        probe_config = critic_config(config, value_head=None)
        # Only the module tree matters: eager attention builds anywhere (a config asking for
        # flash_attention_2 on a machine without it must not fail here).
        probe_config._attn_implementation = "eager"
        with torch.device("meta"):
            model = cls(probe_config)
        linears = [name for name, child in model.named_children()
                   if isinstance(child, torch.nn.Linear) and child.out_features == 1]
        assert len(linears) == 1, f"{cls.__name__} has no single scalar head: {linears}"
        _HEAD_NAMES[cls] = linears[0]
    return _HEAD_NAMES[cls]


def critic_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The critic's scalar head module (works on FSDP-wrapped models too)."""
    return getattr(model, head_name(model.config))


def architecture_name(config: PretrainedConfig) -> str:
    """The `architectures` entry a saved critic of this config carries."""
    if has_token_classification_class(config):
        return MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(config)].__name__
    _architecture_class(config)  # raises for configs with no critic form
    return GENERIC_ARCHITECTURE


def text_hidden_size(config: PretrainedConfig) -> int:
    return config.get_text_config().hidden_size


# critic_config's value_head default: keep the head the config declares (scalar when it declares none).
DECLARED_HEAD = "declared"


def critic_config(hf_config: PretrainedConfig, value_head: HLGaussSupport | None | str = DECLARED_HEAD
                  ) -> PretrainedConfig:
    """A copy of `hf_config` set up for a per-token critic; the input is not modified.

    num_labels=1 (a scalar head) or, for an HL-Gauss head, num_labels=num_bins with the support in
    `critic_value_head` (common/learning/hl_gauss.py); all head dropouts 0.0 (floats), untied embeddings,
    `architectures` naming the critic class, and `hidden_size` mirrored from `text_config` for VLMs
    that lack it at the top. `value_head`: DECLARED_HEAD keeps the kind `hf_config` declares,
    None makes it scalar, an HLGaussSupport makes it that.
    Raises ValueError naming the model type when no critic form exists.
    """
    support = support_of(hf_config) if value_head == DECLARED_HEAD else value_head
    architecture = architecture_name(hf_config)
    config = copy.deepcopy(hf_config)
    if support is None:
        config.num_labels = 1
        config.id2label = {0: "VALUE"}
        config.label2id = {"VALUE": 0}
        if hasattr(config, CONFIG_KEY):
            delattr(config, CONFIG_KEY)
    else:
        config.num_labels = support.num_bins
        config.id2label = {k: f"BIN_{k}" for k in range(support.num_bins)}
        config.label2id = {label: k for k, label in config.id2label.items()}
        setattr(config, CONFIG_KEY, support.to_dict())
    for name in _ZERO_DROPOUTS:
        setattr(config, name, 0.0)
    config.tie_word_embeddings = False
    text_config = config.get_text_config()
    if text_config is not config:
        text_config.tie_word_embeddings = False
        if getattr(config, "hidden_size", None) is None:
            # trl and verl read config.hidden_size; transformers 5 VLM configs only have it in text_config.
            config.hidden_size = text_config.hidden_size
    config.architectures = [architecture]
    return config


def config_in_dtype(config: PretrainedConfig, dtype: torch.dtype) -> PretrainedConfig:
    """A copy of `config` with its dtype, and every sub-config's, set to `dtype`.

    A critic class builds its backbone with `AutoModel.from_config(config)`. Before transformers 5.12,
    `_from_config(config, dtype=...)` left `config.dtype` as the checkpoint declared it, so that nested
    build took the checkpoint's dtype (bf16, as verl saves critics) over the one asked for: an fp32
    engine silently computed its backbone in bf16 under an fp32 head."""
    config = copy.deepcopy(config)
    pending = [config]
    while pending:
        current = pending.pop()
        current.dtype = dtype
        pending += [sub for key in current.sub_configs if (sub := getattr(current, key, None)) is not None]
    return config


def build_critic(config: PretrainedConfig, *, dtype: torch.dtype, attn_implementation: str | None
                 ) -> torch.nn.Module:
    """The critic module of critic config `config` (its class's own initialisation), every parameter
    in `dtype` whatever dtype the config declares, under the current device and init contexts (meta
    builds wrap this). Raises RuntimeError when transformers still builds a parameter in another dtype."""
    config = config_in_dtype(config, dtype)
    cls = critic_class(config)
    model = cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    wrong = [name for name, p in model.named_parameters() if p.is_floating_point() and p.dtype != dtype]
    if wrong:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} built {len(wrong)} parameters of {cls.__name__} "
                           f"in another dtype than {dtype} (e.g. {wrong[:3]}): this transformers version is not "
                           f"supported (docs/SUPPORTED.md)")
    return install_value_head(model)


def install_value_head(model: torch.nn.Module) -> torch.nn.Module:
    """Give a critic built from an HL-Gauss config its HLGaussHead (values from forward, the same
    parameters); a scalar critic is returned as it is. Call right after building the model."""
    support = support_of(model.config)
    name = head_name(model.config)
    head = getattr(model, name)
    if support is not None and not isinstance(head, HLGaussHead):
        setattr(model, name, HLGaussHead.from_linear(head, support))
    return model
