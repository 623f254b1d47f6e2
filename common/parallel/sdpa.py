"""How our attention calls torch's scaled_dot_product_attention with grouped-query heads (GQA), so
that CUDA can still take a fused kernel.

sdpa broadcasts K/V heads itself with `enable_gqa=True`, but on CUDA only its flash backend takes
that, and flash runs bf16/fp16 without a mask. An fp32 call, or any call with a mask, would fall to
the MATH backend, which materialises the whole (L x S) score matrix: slow, and out of memory on long
rows. There the K/V heads are repeated (repeat_interleave, the same values) and the call goes
without `enable_gqa`, so the memory-efficient kernel takes it. On CPU, sdpa's flash kernel takes
`enable_gqa` in every dtype, with or without a mask, and needs no copy of K/V: the heads stay
grouped there (and on devices we have not measured, as before).

`kernel_device` is the seam: tests make a CPU run choose as it would on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import sdpa_broadcasts_kv


def kernel_device(t: torch.Tensor) -> str:
    """The device type attention kernels are chosen for (t's; a seam for tests)."""
    return t.device.type


def repeat_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value (..., Hkv, S, D) with each head repeated for its group of query (..., Hq, L, D) heads."""
    groups = query.shape[-3] // key.shape[-3]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention for q (..., Hq, L, D), k/v (..., Hkv, S, D), Hkv dividing Hq:
    GQA broadcast by sdpa where a fused kernel takes it, else K/V repeated (the same values)."""
    if key.shape[-3] != query.shape[-3]:
        if sdpa_broadcasts_kv(kernel_device(query), query.dtype, kwargs.get("attn_mask") is not None):
            return F.scaled_dot_product_attention(query, key, value, enable_gqa=True, **kwargs)
        key, value = repeat_kv(query, key, value)
    return F.scaled_dot_product_attention(query, key, value, **kwargs)
