"""The load-balanced context-parallel layout: which tokens of a micro-batch each CP rank holds, and
the permutation that puts what the ranks gathered back into sequence order.

Each sequence (padded to a multiple of 2N for N ranks) is cut into 2N equal chunks; rank r holds
chunks r and 2N-1-r, concatenated. Under a causal mask the early chunks are cheap and the late ones
dear, so every rank gets the same work. It is megatron's own layout (get_pos_emb_on_this_cp_rank,
_get_thd_freqs_on_this_cp_rank): megatron's rotary slicing picks the right positions for it, so
rotary needs nothing from us.

Packed rows (THD) are split sequence by sequence: rank r's row is, for each sequence in turn, its
two chunks of it. Padded rows (b, s) are split along s as one sequence of length s.
"""

from __future__ import annotations

import functools

import torch


def chunk_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions (within a sequence of `length`, a multiple of 2 * cp_size) that `cp_rank` holds."""
    assert length % (2 * cp_size) == 0, (length, cp_size)
    chunk = length // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange(late * chunk, (late + 1) * chunk)])


def local_index(bounds: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices into the whole (padded) packed row of the tokens `cp_rank` holds, in its order;
    `bounds`: the sequences' boundaries [0, ..., total] (cu_seqlens), each length a multiple of 2N."""
    pieces = [start + chunk_positions(end - start, cp_size, cp_rank)
              for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def gathered_position(bounds: list[int], cp_size: int) -> torch.Tensor:
    """For each token of the whole row, where it sits in the rank-order concatenation of every
    rank's local tokens (what an all-gather returns): gathered.index_select(dim, this) is the row
    in sequence order. Read-only (cached: every attention layer of a micro-batch asks for it)."""
    return _gathered_position(tuple(bounds), cp_size)


@functools.lru_cache(maxsize=16)
def _gathered_position(bounds: tuple[int, ...], cp_size: int) -> torch.Tensor:
    order = torch.cat([local_index(list(bounds), cp_size, rank) for rank in range(cp_size)])
    return torch.argsort(order)


def pad_sequences(bounds: list[int], cp_size: int, multiple: int) -> list[int]:
    """The boundaries once each sequence is padded up to a multiple of 2N, plus, when the total must
    also divide by `multiple` * 2N (sequence parallelism splits each rank's row over the tensor
    ranks), one dummy sequence at the end."""
    unit = 2 * cp_size
    padded = [0]
    for start, end in zip(bounds[:-1], bounds[1:]):
        padded.append(padded[-1] + -(-(end - start) // unit) * unit)
    total = -(-padded[-1] // (unit * multiple)) * unit * multiple
    if total > padded[-1]:
        padded.append(total)
    return padded


# -- attention of this rank's chunks without a dense mask ------------------------------------------
def _flash_cpu(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_cpu_backward(grad, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


class _PrefixCausalAttention(torch.autograd.Function):
    """Queries of one chunk, at positions [p, p + C) of their sequence, against the keys [0, p + C):
    the prefix [0, p) is wholly visible, the diagonal block [p, p + C) causally. Two flash-attention
    calls (no mask, so no (C, p + C) mask is ever built: at 16k tokens that mask alone outweighed
    the memory the split saves) joined by their log-sum-exps; the backward runs each block's flash
    backward against the joined output and log-sum-exp, which gives the gradient of the whole."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_diag, v_diag, scale):
        out_d, lse_d = _flash_cpu(q, k_diag, v_diag, True, scale)
        if k_prefix.shape[2] == 0:
            out, lse = out_d, lse_d
        else:
            out_p, lse_p = _flash_cpu(q, k_prefix, v_prefix, False, scale)
            lse = torch.logaddexp(lse_p, lse_d)
            wide = torch.promote_types(q.dtype, torch.float32)  # join bf16 outputs in fp32, fp64 in fp64
            out = (out_p.to(wide) * torch.exp(lse_p - lse)[..., None].to(wide)
                   + out_d.to(wide) * torch.exp(lse_d - lse)[..., None].to(wide)).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_prefix, v_prefix, k_diag, v_diag, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk_d, dv_d = _flash_cpu_backward(grad, q, k_diag, v_diag, out, lse, True, ctx.scale)
        dk_p = dv_p = None
        if k_prefix.shape[2]:
            dq_p, dk_p, dv_p = _flash_cpu_backward(grad, q, k_prefix, v_prefix, out, lse, False, ctx.scale)
            dq = dq + dq_p
        else:
            dk_p, dv_p = torch.zeros_like(k_prefix), torch.zeros_like(v_prefix)
        return dq, dk_p, dv_p, dk_d, dv_d, None


def chunk_attention(q, k, v, cp_size: int, cp_rank: int, scale: float) -> torch.Tensor | None:
    """This rank's queries (S, h, span / N, d) — its chunks r and 2N-1-r of each of S sequences —
    against every key of them (S, h, span, d), causally by position: (S, h, span / N, d). None when
    the flash kernel is not there for these tensors (not on CPU): the caller masks instead."""
    if q.device.type != "cpu" or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return None
    span = k.shape[2]
    chunk = span // (2 * cp_size)
    outs = []
    for i, c in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        start = c * chunk
        q_c = q[:, :, i * chunk:(i + 1) * chunk]
        pieces = [t[:, :, lo:hi] for t in (k, v) for lo, hi in ((0, start), (start, start + chunk))]
        k_p, k_d, v_p, v_d = pieces
        outs.append(_PrefixCausalAttention.apply(q_c, k_p, v_p, k_d, v_d, scale))
    return torch.cat(outs, dim=2)
