"""Micro-batching by token budget, and packing sequences without padding.

A mini-batch of padded rows [B, T] is split into micro-batches, each of which is either packed
(its sequences concatenated into one row, position ids restarting at 0 per sequence) or kept
padded (trimmed to its longest sequence). Values computed on a micro-batch are scattered back to
the rows' [b, T] layout, so the loss never needs to know which layout ran.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch


def sequence_lengths(attention_mask: torch.Tensor) -> list[int]:
    return attention_mask.sum(dim=-1).tolist()


def plan_token_budget(lengths: list[int], budget: int, *, min_micro_batches: int = 1) -> list[list[int]]:
    """Split sequences into micro-batches of at most `budget` tokens, balanced by token count.

    Longest-first greedy onto the lightest micro-batch (LPT). A sequence longer than the budget
    gets a micro-batch of its own. At least `min_micro_batches` are returned (some may be empty when
    there are fewer sequences), so that every data-parallel rank runs the same number.
    Each micro-batch lists row indices in ascending order.
    """
    # A sequence over the budget fills a micro-batch on its own: count it as exactly one budget.
    total = sum(min(n, budget) for n in lengths)
    count = max(min_micro_batches, -(-total // budget) if total else 1)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    while True:
        heap = [(0, k) for k in range(count)]
        bins: list[list[int]] = [[] for _ in range(count)]
        overflow = False
        for index in order:
            load, k = heapq.heappop(heap)
            if load and load + lengths[index] > budget:
                overflow = True
                break
            bins[k].append(index)
            heapq.heappush(heap, (load + lengths[index], k))
        if not overflow:
            return [sorted(b) for b in bins]
        count += 1


def data_parallel_shares(attention_mask: torch.Tensor, dp_size: int,
                         extra_tokens: list[int] | None = None) -> list[torch.Tensor]:
    """Each data-parallel rank's rows of a mini-batch [B, T], balanced by token count: longest row
    first onto the share with the fewest tokens (ties: the lower share), each share's rows in
    ascending order. Deterministic from the mask, so every rank computes the same shares (verl
    balances its data-parallel shares by tokens the same way). The loss is normalised over the whole
    mini-batch whatever the shares are, so they change where the work runs, not the step.
    extra_tokens: per row, work beyond its tokens counted as tokens (a vision critic's image
    patches, common.valuehead.multimodal.vision_patches: the vision tower runs on every one)."""
    lengths = sequence_lengths(attention_mask)
    if extra_tokens is not None:
        lengths = [length + extra for length, extra in zip(lengths, extra_tokens)]
    order = sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))
    loads = [(0, share) for share in range(dp_size)]  # (tokens, share index): a heap
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for row in order:
        tokens, share = heapq.heappop(loads)
        shares[share].append(row)
        heapq.heappush(loads, (tokens + lengths[row], share))
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in shares]


def plan_fixed_size(num_rows: int, micro_batch_size: int, *, min_micro_batches: int = 1) -> list[list[int]]:
    """The classic split: consecutive chunks of `micro_batch_size` rows (padded to a common count)."""
    chunks = [list(range(i, min(i + micro_batch_size, num_rows))) for i in range(0, num_rows, micro_batch_size)]
    return chunks + [[] for _ in range(min_micro_batches - len(chunks))]


@dataclasses.dataclass(frozen=True, slots=True)
class MicroBatch:
    """Model inputs for some rows of a mini-batch, and where each output value goes back."""

    rows: list[int]
    """Row indices into the mini-batch."""
    input_ids: torch.Tensor
    """(1, N) when packed, else (len(rows), T_mb)."""
    attention_mask: torch.Tensor | None
    """None when packed (per-sequence attention comes from position_ids)."""
    position_ids: torch.Tensor | None
    """(1, N) restarting at 0 per sequence when packed."""
    scatter_rows: torch.Tensor
    """For each model output position: index into `rows` ..."""
    scatter_cols: torch.Tensor
    """... and the column of the original [B, T] row it belongs to."""
    gather_index: tuple[torch.Tensor, torch.Tensor] | None
    """Where to read valid outputs in the model's output layout (None: everything is valid)."""
    model_inputs: dict | None = None
    """Further model kwargs for these rows (a vision critic's images: common.valuehead.multimodal.lay_out,
    which also makes position_ids [4, b, N]: text positions, then the multimodal rope's t/h/w)."""

    @property
    def num_tokens(self) -> int:
        return int(self.scatter_rows.numel())

    def unpack(self, outputs: torch.Tensor, row_length: int) -> torch.Tensor:
        """Model outputs (1, N, ...) or (b, T_mb, ...) -> (len(rows), row_length, ...), zero on padding
        (trailing dimensions, e.g. an HL-Gauss head's bins, are carried along)."""
        valid = outputs if self.gather_index is None else outputs[self.gather_index]
        trailing = tuple(outputs.shape[2:])
        valid = valid.reshape(-1, *trailing)
        out = valid.new_zeros(len(self.rows), row_length, *trailing)
        return out.index_put((self.scatter_rows, self.scatter_cols), valid)


def _valid_positions(attention_mask: torch.Tensor, rows: list[int]):
    mask = attention_mask[rows].bool()
    local_rows, cols = mask.nonzero(as_tuple=True)  # row-major: each sequence's tokens in order
    return local_rows, cols


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int]) -> MicroBatch:
    """Concatenate the valid tokens of `rows` into one row; position ids restart per sequence.

    Works for any padding side as long as each row's valid tokens are one contiguous span.
    """
    local_rows, cols = _valid_positions(attention_mask, rows)
    ids = input_ids[rows][local_rows, cols][None]
    lengths = attention_mask[rows].sum(dim=-1)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(ids.shape[1]) - starts.repeat_interleave(lengths)
    return MicroBatch(rows, ids, None, positions[None], local_rows, cols, None)


def pad(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int]) -> MicroBatch:
    """Keep `rows` padded, trimmed to the longest valid span among them."""
    mask = attention_mask[rows]
    used = mask.any(dim=0).nonzero()
    first, last = int(used.min()), int(used.max()) + 1
    sub_mask = mask[:, first:last]
    local_rows, cols = sub_mask.bool().nonzero(as_tuple=True)
    ids = input_ids[rows][:, first:last] * sub_mask  # whatever sits under padding never reaches the embedding
    return MicroBatch(rows, ids, sub_mask, None, local_rows, cols + first, (local_rows, cols))


def empty_micro_batch(pad_token_id: int = 0) -> MicroBatch:
    """One dummy token, for a rank with fewer sequences than micro-batches (its loss is zeroed)."""
    ids = torch.full((1, 1), pad_token_id, dtype=torch.long)
    return MicroBatch([], ids, None, torch.zeros(1, 1, dtype=torch.long),
                      torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                      (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))


def make_micro_batches(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    packing: bool,
    token_budget: int,
    micro_batch_size: int | None = None,
    min_micro_batches: int = 1,
) -> list[MicroBatch]:
    """Plan and build the micro-batches of one (per-rank) mini-batch."""
    lengths = sequence_lengths(attention_mask)
    if micro_batch_size is not None:
        plan = plan_fixed_size(len(lengths), micro_batch_size, min_micro_batches=min_micro_batches)
    else:
        plan = plan_token_budget(lengths, token_budget, min_micro_batches=min_micro_batches)
    build = pack if packing else pad
    return [build(input_ids, attention_mask, rows) if rows else empty_micro_batch() for rows in plan]


def count_micro_batches(attention_mask: torch.Tensor, *, token_budget: int, micro_batch_size: int | None) -> int:
    lengths = sequence_lengths(attention_mask)
    if micro_batch_size is not None:
        return len(plan_fixed_size(len(lengths), micro_batch_size))
    return len(plan_token_budget(lengths, token_budget))
