"""The attention load_critic builds a critic with: common.parallel.kernels' policy for padded rows."""

from __future__ import annotations

import torch

from ..parallel import kernels


def flash_attention_available() -> bool:
    """flash_attn is importable and a CUDA device is present (it has no CPU kernels)."""
    return kernels.installed().flash_attn


def attention_choice(critic_cls: type, dtype: torch.dtype = torch.float32, *,
                     have: kernels.Installed | None = None) -> kernels.Choice:
    """The attention for padded rows of `critic_cls` computing in `dtype` (kernels.attention)."""
    return kernels.attention(compute_dtype=dtype, packed=False, have=have or kernels.installed(),
                             flash_capable=critic_cls._supports_flash_attn, sdpa_capable=critic_cls._supports_sdpa)


def select_attn_implementation(critic_cls: type, requested: str | None = None,
                               dtype: torch.dtype = torch.float32) -> str:
    """`requested` wins (an engine checks its own against the dtype it computes in: parameters may be
    fp32 under bf16 mixed precision); otherwise flash_attention_2 (CUDA, bf16/fp16, flash_attn
    installed) > sdpa > eager, as the class allows, for parameters in `dtype`."""
    if requested is not None:
        return requested
    return attention_choice(critic_cls, dtype).kernel


# Attentions of our own that take the text model's rows only (packed sequences, Ulysses' split heads).
_TEXT_ONLY = (kernels.PACKED_SDPA, kernels.TORCH_VARLEN, "critic_ulysses_attention")


def per_tower(config, attn: str | None):
    """The attn_implementation to build `config`'s critic with: `attn`, or for a vision-language
    critic given one of our text-only attentions, that for the language model and sdpa for the vision
    tower (which runs on its patches, not on packed token rows: our packed attention there would
    read the text's sequence bounds)."""
    if attn in _TEXT_ONLY and getattr(config, "vision_config", None) is not None:
        return {"text_config": attn, "vision_config": "sdpa"}
    return attn
