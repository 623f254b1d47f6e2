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
