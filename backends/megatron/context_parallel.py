"""The load-balanced context-parallel layout: which tokens of a micro-batch each CP rank holds, and
the permutation that puts what the ranks gathered back into sequence order.

Each sequence (padded to a multiple of 2N for N ranks) is cut into 2N equal chunks; rank r holds
chunks r and 2N-1-r, concatenated. Under a causal mask the early chunks are cheap and the late ones
dear, so every rank gets the same work. It is megatron's own layout (get_pos_emb_on_this_cp_rank,
_get_thd_freqs_on_this_cp_rank): megatron's rotary slicing picks the right positions for it, so
rotary needs nothing from us.

Packed rows (THD) are split sequence by sequence: rank r's row is, for each sequence in turn, its
two chunks of it. Padded rows (b, s) are split along s as one sequence of length s.

Each of a packed rank's chunks attends without a dense mask (chunk_attention): to its prefix
(wholly visible) and its diagonal block (causal), two calls of a kernel that returns its
log-sum-exp, joined by them. The kernel is chosen by device and dtype (LSE_KERNELS: CPU's flash
kernel; on CUDA flash for bf16/fp16, the memory-efficient kernel for fp32), the device through
common.parallel.sdpa.kernel_device, which tests set to "cuda".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from ...common.parallel import sdpa


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
@dataclasses.dataclass(frozen=True, slots=True)
class LseKernel:
    """An attention kernel that returns its log-sum-exp, which lets two partial attentions be joined:
    forward(q, k, v, causal, scale) -> (out, lse (S, h, Lq) fp32, aux) and
    backward(grad, q, k, v, out, lse, aux, causal, scale) -> (dq, dk, dv), where out and lse may be
    the joined ones (flash-style backwards take any out / lse whose rows they belong to); aux is
    what the forward hands its backward. q, k, v have as many heads each."""

    name: str
    forward: Callable
    backward: Callable


def _cpu_flash(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_flash_backward(grad, q, k, v, out, lse, aux, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _cuda_flash(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_flash_backward(grad, q, k, v, out, lse, aux, causal, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _cuda_efficient(q, k, v, causal, scale):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    # The kernel pads the log-sum-exp's query dim to a multiple of 32; its backward wants it so again.
    return out, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])


def _cuda_efficient_backward(grad, q, k, v, out, lse, aux, causal, scale):
    seed, offset, padded = aux
    lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


CPU_FLASH = LseKernel("cpu flash", _cpu_flash, _cpu_flash_backward)
CUDA_FLASH = LseKernel("cuda flash", _cuda_flash, _cuda_flash_backward)
CUDA_EFFICIENT = LseKernel("cuda memory-efficient", _cuda_efficient, _cuda_efficient_backward)

# (device type, dtype) -> the kernel; a dtype of None: any dtype. CUDA's flash kernel runs bf16/fp16
# only, its memory-efficient one fp32 too. Elsewhere (CUDA fp64, other devices) there is none, and
# the caller masks instead.
LSE_KERNELS: dict[tuple[str, torch.dtype | None], LseKernel] = {
    ("cpu", None): CPU_FLASH,
    ("cuda", torch.bfloat16): CUDA_FLASH,
    ("cuda", torch.float16): CUDA_FLASH,
    ("cuda", torch.float32): CUDA_EFFICIENT,
}


def lse_kernel(device_type: str, dtype: torch.dtype) -> LseKernel | None:
    """The log-sum-exp kernel for these tensors, or None."""
    return LSE_KERNELS.get((device_type, dtype)) or LSE_KERNELS.get((device_type, None))


class _PrefixCausalAttention(torch.autograd.Function):
    """Queries of one chunk, at positions [p, p + C) of their sequence, against the keys [0, p + C):
    the prefix [0, p) is wholly visible, the diagonal block [p, p + C) causally. Two kernel calls
    (no mask, so no (C, p + C) mask is ever built: at 16k tokens that mask alone outweighed the
    memory the split saves) joined by their log-sum-exps; the backward runs each block's kernel
    backward against the joined output and log-sum-exp, which gives the gradient of the whole."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_diag, v_diag, scale, kernel):
        out_d, lse_d, aux_d = kernel.forward(q, k_diag, v_diag, True, scale)
        aux_p = None
        if k_prefix.shape[2] == 0:
            out, lse = out_d, lse_d
        else:
            out_p, lse_p, aux_p = kernel.forward(q, k_prefix, v_prefix, False, scale)
            lse = torch.logaddexp(lse_p, lse_d)
            wide = torch.promote_types(q.dtype, torch.float32)  # join bf16 outputs in fp32, fp64 in fp64
            out = (out_p.to(wide) * torch.exp(lse_p - lse)[..., None].to(wide)
                   + out_d.to(wide) * torch.exp(lse_d - lse)[..., None].to(wide)).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, out, lse)
        ctx.scale, ctx.kernel, ctx.aux = scale, kernel, (aux_p, aux_d)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_prefix, v_prefix, k_diag, v_diag, out, lse = ctx.saved_tensors
        kernel, (aux_p, aux_d) = ctx.kernel, ctx.aux
        grad = grad.contiguous()
        dq, dk_d, dv_d = kernel.backward(grad, q, k_diag, v_diag, out, lse, aux_d, True, ctx.scale)
        if k_prefix.shape[2]:
            dq_p, dk_p, dv_p = kernel.backward(grad, q, k_prefix, v_prefix, out, lse, aux_p, False, ctx.scale)
            dq = dq + dq_p
        else:
            dk_p, dv_p = torch.zeros_like(k_prefix), torch.zeros_like(v_prefix)
        return dq, dk_p, dv_p, dk_d, dv_d, None, None


def chunk_mask(span: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """The dense (span / N, span) causal mask of this rank's chunks by global position: what
    attention without a log-sum-exp kernel needs (and what chunk_attention avoids)."""
    mine = chunk_positions(span, cp_size, cp_rank).to(device)
    return mine[:, None] >= torch.arange(span, device=device)[None]


def chunk_attention(q, k, v, cp_size: int, cp_rank: int, scale: float) -> torch.Tensor | None:
    """This rank's queries (S, h, span / N, d) — its chunks r and 2N-1-r of each of S sequences —
    against every key of them (S, h, span, d), causally by position: (S, h, span / N, d). None when
    no log-sum-exp kernel runs these tensors (lse_kernel): the caller masks instead."""
    kernel = lse_kernel(sdpa.kernel_device(q), q.dtype)
    if kernel is None:
        return None
    span = k.shape[2]
    chunk = span // (2 * cp_size)
    outs = []
    for i, c in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        start = c * chunk
        q_c = q[:, :, i * chunk:(i + 1) * chunk]
        pieces = [t[:, :, lo:hi] for t in (k, v) for lo, hi in ((0, start), (start, start + chunk))]
        k_p, k_d, v_p, v_d = pieces
        outs.append(_PrefixCausalAttention.apply(q_c, k_p, v_p, k_d, v_d, scale, kernel))
    return torch.cat(outs, dim=2)
