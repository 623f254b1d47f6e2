"""Choose the attention implementation: flash-attention when it can run, else sdpa, else eager."""

from __future__ import annotations

import importlib.util

import torch


def flash_attention_available() -> bool:
    """flash_attn is importable and a CUDA device is present (it has no CPU kernels)."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def select_attn_implementation(critic_cls: type, requested: str | None = None) -> str:
    """`requested` wins; otherwise flash_attention_2 > sdpa > eager, as the model class allows."""
    if requested is not None:
        return requested
    if flash_attention_available() and critic_cls._supports_flash_attn:
        return "flash_attention_2"
    if critic_cls._supports_sdpa:
        return "sdpa"
    return "eager"
