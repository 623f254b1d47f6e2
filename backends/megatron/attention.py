"""Core attention for the CPU (local) layer spec: sdpa per sequence for packed rows, never a dense
N x N mask over a packed row.

It takes the place of megatron's DotProductAttention in the layer spec. Packed rows arrive in
megatron's THD layout (PackedSeqParams with qkv_format="thd": q (t, np, hn), k/v (t, ng, hn), with
rotary already applied per sequence from cu_seqlens); each sequence runs causal sdpa on its own
span, spans of equal length batched in one call, as common/parallel/packed_attention.py does for HF models.
Padded rows arrive as (s, b, n, hn) with a boolean [b, 1, s, s] mask (True = masked out).
On GPU with TransformerEngine, TE's attention takes the same PackedSeqParams instead.

Context parallelism (the Llama 3 way): each rank holds its two chunks of every sequence
(context_parallel.py); keys and values are all-gathered over the CP group (the backward
reduce-scatters their gradients) and put back in sequence order, and this rank's queries attend to
all of them under the causal mask of their global positions, per sequence for packed rows: without
a mask where a log-sum-exp kernel runs the tensors (context_parallel.chunk_attention; CPU, and CUDA
in bf16/fp16/fp32), with a (L/N x L) mask otherwise (and under attention dropout).
Grouped K/V heads reach sdpa through common.parallel.sdpa (repeated where CUDA would otherwise fall
to its MATH kernel).
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from . import context_parallel as cp
from ...common.parallel.sdpa import repeat_kv, sdpa
from ...common.parallel.sequence_parallel import all_gather_summed_grad, group_rank, group_size


def gather_keys(x: torch.Tensor, group, bounds: list[int]) -> torch.Tensor:
    """Every CP rank's keys (or values) along dim 0, in sequence order; `bounds`: the (padded)
    sequences of the whole row. A module function, so the tests' negative control can replace it."""
    gathered = all_gather_summed_grad(x, group, dim=0)
    return gathered.index_select(0, cp.gathered_position(bounds, group_size(group)).to(x.device))


class PackedCoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_size, self.cp_group = config.context_parallel_size, None
        if self.cp_size > 1:
            self.cp_group = pg_collection.cp if pg_collection is not None else parallel_state.get_context_parallel_group()
            assert group_size(self.cp_group) == self.cp_size, (group_size(self.cp_group), self.cp_size)

    def _sdpa(self, q, k, v, **kwargs):
        """q (n, h, Lq, d), k/v (n, g, Lk, d) -> (n, h, Lq, d); grouped heads as common.parallel.sdpa calls them."""
        dropout = self.dropout if self.training else 0.0
        if dropout:  # dropout on tensor-parallel heads draws from the model-parallel RNG, as megatron's does
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return sdpa(q, k, v, dropout_p=dropout, scale=self.scale, **kwargs)
        return sdpa(q, k, v, scale=self.scale, **kwargs)

    def _packed(self, query, key, value, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """THD: q (t, np, hn), k/v (t, ng, hn) -> (t, np * hn), attention within each sequence.
        Under CP, q is this rank's t / N tokens and `cu_seqlens` bound the whole (padded) sequences."""
        bounds = cu_seqlens.tolist()
        n = self.cp_size
        if n > 1:
            key, value = (gather_keys(t, self.cp_group, bounds) for t in (key, value))
        by_length: dict[int, list[tuple[int, int]]] = {}
        local = 0  # where the sequence's queries start in this rank's row
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                by_length.setdefault(end - start, []).append((local, start))
                local += (end - start) // n
        out = query.new_empty(query.shape)
        device = query.device
        for span, starts in by_length.items():
            q_starts, k_starts = (torch.tensor(s, device=device)[:, None] for s in zip(*starts))
            q_index = (q_starts + torch.arange(span // n, device=device)).flatten()
            k_index = (k_starts + torch.arange(span, device=device)).flatten()
            # (S * L, h, d) -> (S, h, L, d): all spans of this length in one call.
            q = query[q_index].unflatten(0, (len(starts), span // n)).transpose(1, 2)
            k, v = (t[k_index].unflatten(0, (len(starts), span)).transpose(1, 2) for t in (key, value))
            if n == 1:
                context = self._sdpa(q, k, v, is_causal=True)
            else:  # this rank's queries sit at its chunks' positions of the sequence
                context = self._chunks(q, k, v, span)
            out[q_index] = context.transpose(1, 2).flatten(0, 1)
        return out.flatten(1)

    def _chunks(self, q, k, v, span: int) -> torch.Tensor:
        """CP, packed: q (S, h, span / N, d) of this rank's two chunks, k/v (S, g, span, d) whole."""
        rank = group_rank(self.cp_group)
        dropout = self.dropout if self.training else 0.0
        if not dropout:
            k, v = repeat_kv(q, k, v)  # the kernels that return a log-sum-exp take as many KV heads as query heads
            context = cp.chunk_attention(q, k, v, self.cp_size, rank, self.scale)
            if context is not None:
                return context
        return self._sdpa(q, k, v, attn_mask=cp.chunk_mask(span, self.cp_size, rank, q.device))

    def _padded(self, query, key, value, attention_mask) -> torch.Tensor:
        """(s, b, n, d) -> (s, b, n * d); mask (b, 1, s, s) True = masked out ((b, 1, s / N, s) under CP)."""
        if self.cp_size > 1:
            s = query.shape[0] * self.cp_size
            key, value = (gather_keys(t, self.cp_group, [0, s]) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, n, s, d)
        if attention_mask is None:
            assert self.cp_size == 1, "context parallelism gives padded rows a mask (inputs.py)"
            context = self._sdpa(q, k, v, is_causal=True)
        else:
            keep = ~attention_mask
            # A query that may see nothing (padding) would give NaN: let it see itself; never read.
            rows = torch.arange(keep.shape[-2], device=keep.device)
            columns = rows if self.cp_size == 1 else cp.chunk_positions(
                keep.shape[-1], self.cp_size, group_rank(self.cp_group)).to(keep.device)
            keep = keep.clone()
            keep[..., rows, columns] = True
            context = self._sdpa(q, k, v, attn_mask=keep)
        s, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)  # (s, b, np * hn)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None, "attention bias is not supported"
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
            return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)
        return self._padded(query, key, value, attention_mask)
