"""Collectives for splitting a sequence across ranks, with the gradients they need: written once,
used by Ulysses attention (common/parallel/ulysses.py: the fsdp and veomni engines) and by megatron's
context parallelism.

All of them run on gloo (CPU) as well as NCCL: they use `all_to_all_single`, `all_gather` of equal shapes and
`reduce_scatter_tensor` on contiguous buffers (gloo's all_gather_into_tensor wants a flat output).

`gather_sequence`'s backward is a slice, not a reduction: it is meant for the layout where every
rank of the group computes the *same* loss from the gathered values, so the gradient of this
rank's piece is simply its slice of the full gradient (a sum over ranks would count it N times).
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist


# torch 2.13 renamed reduce_scatter_tensor (now a deprecated alias) to reduce_scatter_single.
_reduce_scatter = getattr(torch_dist, "reduce_scatter_single", None) or torch_dist.reduce_scatter_tensor


def group_size(group) -> int:
    return torch_dist.get_world_size(group)


def group_rank(group) -> int:
    return torch_dist.get_rank(group)


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x into N chunks along scatter_dim, send chunk j to rank j, and concatenate what arrives
    along gather_dim (in rank order)."""
    n = group_size(group)
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all-to-all over {n} ranks: dimension {scatter_dim} of {tuple(x.shape)} does not divide by {n}")
    # (N, ...chunk): chunk j first, so all_to_all_single's equal dim-0 split sends it to rank j.
    send = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    torch_dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an all-to-all is the all-to-all with the two dimensions swapped.
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: x's scatter_dim is split over the group's ranks and its gather_dim
    grows N-fold. Ulysses: (B, H, n, D) heads scattered, sequence gathered -> (B, H/N, N n, D)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(group_size(group))]
    torch_dist.all_gather(pieces, x, group=group)  # equal shapes: the list form works on gloo
    return torch.cat(pieces, dim=dim)


class _Gather(torch.autograd.Function):
    """All-gather along dim; backward: this rank's slice of the gradient (sum_grads False), or that
    slice summed over the ranks (sum_grads True: a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, dim, sum_grads):
        ctx.group, ctx.dim, ctx.length, ctx.sum_grads = group, dim, x.shape[dim], sum_grads
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.sum_grads:
            start = group_rank(ctx.group) * ctx.length
            return grad.narrow(ctx.dim, start, ctx.length), None, None, None
        n = group_size(ctx.group)
        pieces = torch.stack(grad.chunk(n, dim=ctx.dim)).contiguous()
        out = pieces.new_empty(pieces.shape[1:])
        _reduce_scatter(out, pieces.flatten(0, 1), group=ctx.group)
        return out, None, None, None


def gather_sequence(x: torch.Tensor, group, *, dim: int) -> torch.Tensor:
    """Every rank's equal-sized piece of x, concatenated along dim in rank order. Backward: this
    rank's slice of the gradient (every rank computes the same loss from the result; see above)."""
    if group_size(group) == 1:
        return x
    return _Gather.apply(x, group, dim, False)


def all_gather_summed_grad(x: torch.Tensor, group, *, dim: int) -> torch.Tensor:
    """Every rank's piece of x concatenated along dim; backward sums each piece's gradient over the
    ranks that used it (reduce-scatter). For keys and values gathered in context-parallel attention,
    where each rank's queries read every rank's keys."""
    if group_size(group) == 1:
        return x
    return _Gather.apply(x, group, dim, True)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
