"""Packed rows on CUDA without flash_attn: torch's own varlen flash kernel, `critic_varlen_attention`.

torch.nn.attention.varlen.varlen_attn (torch >= 2.10 with `window_size`) is FA2 with cumulative
sequence bounds, as flash_attn's varlen kernel is, shipped with torch: packed rows on a GPU are fast
without a source build of flash_attn (torchtitan uses it the same way). CUDA and bf16/fp16 only, no
logit soft-capping and no dropout: common.parallel.kernels picks it only where it runs.

The sequence bounds are the ones packed attention reads (stated by compute_values through
common.parallel.packed_attention.stated_bounds, else the position ids' restarts); every packed row
is flattened into one token stream with its spans as the cumulative bounds.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .kernels import PACKED_SDPA, TORCH_VARLEN
from .packed_attention import _refuse_padding_mask, _row_spans

ATTENTION_NAME = TORCH_VARLEN


def _kernel():
    """torch's varlen_attn (a seam: CPU tests put a reference kernel in its place)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def cumulative_bounds(spans: list[list[tuple[int, int]]], length: int, device) -> tuple[torch.Tensor, int]:
    """(int32 cu_seqlens over the flattened rows, the longest span) for rows of `length` tokens."""
    starts = [b * length + start for b, row in enumerate(spans) for start, _ in row]
    longest = max(end - start for row in spans for start, end in row)
    return torch.tensor([*starts, len(spans) * length], dtype=torch.int32, device=device), longest


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, N, D), key/value (B, Hkv, N, D) -> (B, N, Hq, D), as transformers expects."""
    assert attention_mask is None, f"{ATTENTION_NAME} never receives a mask (packed rows only)"
    if softcap is not None or (dropout and module.training):
        raise ValueError(f"{ATTENTION_NAME} takes no logit soft-capping or attention dropout: set "
                         f"engine.model.attn_implementation={PACKED_SDPA}")
    batch, heads, length, dim = query.shape
    spans = [_row_spans(b, length, position_ids) for b in range(batch)]
    bounds, longest = cumulative_bounds(spans, length, query.device)
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    # transformers' sliding window keeps keys at distance < window; flash's (left, 0) keeps distance <= left.
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    out = _kernel()(q, k, v, bounds, bounds, longest, longest, scale=scaling, window_size=window,
                    enable_gqa=key.shape[1] != heads)
    return out.reshape(batch, length, heads, dim), None


def register() -> str:
    """Make ATTENTION_NAME known to transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _refuse_padding_mask)
    return ATTENTION_NAME
