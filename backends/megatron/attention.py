"""Core attention for the CPU (local) layer spec: sdpa per sequence for packed rows, never a dense
N x N mask over a packed row.

It takes the place of megatron's DotProductAttention in the layer spec. Packed rows arrive in
megatron's THD layout (PackedSeqParams with qkv_format="thd": q (t, np, hn), k/v (t, ng, hn), with
rotary already applied per sequence from cu_seqlens); each sequence runs causal sdpa on its own
span, spans of equal length batched in one call, as common/packed_attention.py does for HF models.
Padded rows arrive as (s, b, n, hn) with a boolean [b, 1, s, s] mask (True = masked out).
On GPU with TransformerEngine, TE's attention takes the same PackedSeqParams instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class PackedCoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedCoreAttention runs without context parallelism (engine.parallel.context=1)")
        tp = config.tensor_model_parallel_size
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q, k, v, **kwargs):
        """q (n, h, L, d), k/v (n, g, L, d) -> (n, h, L, d)."""
        dropout = self.dropout if self.training else 0.0
        if dropout:  # dropout on tensor-parallel heads draws from the model-parallel RNG, as megatron's does
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=self.scale,
                                                      enable_gqa=self.groups != self.heads, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=self.groups != self.heads,
                                              **kwargs)

    def _packed(self, query, key, value, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """THD: q (t, np, hn), k/v (t, ng, hn) -> (t, np * hn), attention within each sequence."""
        bounds = cu_seqlens.tolist()
        by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                by_length.setdefault(end - start, []).append(start)
        out = query.new_empty(query.shape)
        for span, starts in by_length.items():
            index = (torch.tensor(starts, device=query.device)[:, None]
                     + torch.arange(span, device=query.device)).flatten()
            # (S * L, h, d) -> (S, h, L, d): all spans of this length in one call.
            q, k, v = (t[index].unflatten(0, (len(starts), span)).transpose(1, 2) for t in (query, key, value))
            out[index] = self._sdpa(q, k, v, is_causal=True).transpose(1, 2).flatten(0, 1)
        return out.flatten(1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None, "attention bias is not supported"
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
            return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)
        # (s, b, n, d) -> (b, n, s, d); mask True = masked out, so sdpa's keep-mask is its negation.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            context = self._sdpa(q, k, v, is_causal=True)
        else:
            keep = ~attention_mask
            # A query that may see nothing (padding) would give NaN: let it see itself; never read.
            keep = keep | torch.eye(keep.shape[-1], dtype=torch.bool, device=keep.device)
            context = self._sdpa(q, k, v, attn_mask=keep)
        s, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)  # (s, b, np * hn)
