"""A common.parallel.batching MicroBatch as megatron-core GPTModel inputs.

Packed rows become THD inputs: ids (1, N), position ids restarting per sequence, and
PackedSeqParams whose cu_seqlens bound the per-sequence attention (attention.py on CPU, TE on
GPU). Padded rows get arange positions and a boolean [b, 1, s, s] mask (True = masked out), as HF
uses for padded rows. Under sequence parallelism the sequence length must divide by the tensor
degree: packed rows get one extra dummy sequence, padded rows extra masked columns; `crop` drops
them again.

Under context parallelism (N ranks) each rank gets its part of every sequence (context_parallel.py):
packed sequences are first padded to a multiple of 2N with dummy tokens, cu_seqlens bound the
padded sequences (what megatron's rotary and attention.py expect), and padded rows are padded to a
multiple of 2N columns, their mask cut to this rank's query rows [b, 1, s / N, s]. `crop` gathers
the values of every rank and puts them back in the micro-batch's order.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from . import context_parallel as cp
from ...common.parallel.batching import MicroBatch
from ...common.parallel.sequence_parallel import gather_sequence, group_rank, group_size, round_up


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    """(b, s): (1, N) when packed; this rank's part under context parallelism."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """(b, 1, s, s) bool, True = masked out (s / N query rows under CP); None when packed."""
    packed_seq_params: PackedSeqParams | None
    length: int
    """Columns of the micro-batch before any padding."""
    cp_group: object = None
    """The context-parallel group when the micro-batch is split over it, else None."""
    value_index: torch.Tensor | None = None
    """Under CP: for each of the `length` columns, its place among the gathered outputs."""

    def crop(self, values: torch.Tensor) -> torch.Tensor:
        """(b, s, ...) values of this rank -> (b, length, ...): what MicroBatch.unpack expects. Under CP
        the values of every rank are gathered first; each rank then computes the same loss from them,
        so the gather's backward is this rank's slice (common/parallel/sequence_parallel.py)."""
        if self.cp_group is None:
            return values[:, : self.length]
        gathered = gather_sequence(values, self.cp_group, dim=1)
        return gathered.index_select(1, self.value_index.to(values.device))


def _packed_bounds(positions: torch.Tensor) -> list[int]:
    """[0, ..., N]: where the sequences of a packed row start (position 0), and its end."""
    return (positions == 0).nonzero().flatten().tolist() + [positions.numel()]


def _thd_params(bounds: list[int], device) -> PackedSeqParams:
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def model_inputs(mb: MicroBatch, *, multiple: int = 1, cp_group=None, device=None) -> ModelInputs:
    """Inputs for one micro-batch; `multiple`: the sequence length must divide by it (SP);
    `cp_group`: split it over the context-parallel ranks (None or one rank: not split)."""
    if cp_group is not None and group_size(cp_group) > 1:
        return _split_inputs(mb, multiple, cp_group, device)
    if mb.position_ids is not None:  # packed: one row of concatenated sequences
        length = mb.position_ids.shape[1]
        bounds = _packed_bounds(mb.position_ids[0])
        padded = round_up(length, multiple)
        ids, pos = mb.input_ids, mb.position_ids
        if padded > length:  # one dummy sequence fills the row up; its values are dropped
            extra = padded - length
            ids = torch.cat([ids, ids.new_zeros(1, extra)], dim=1)
            pos = torch.cat([pos, torch.arange(extra)[None]], dim=1)
            bounds.append(padded)
        return ModelInputs(ids.to(device), pos.to(device), None, _thd_params(bounds, device), length)
    b, length = mb.attention_mask.shape
    ids, mask = _pad_columns(mb, round_up(length, multiple))
    positions = torch.arange(ids.shape[1])[None].expand(b, -1)
    return ModelInputs(ids.to(device), positions.to(device), _causal_mask(mask).to(device), None, length)


def _pad_columns(mb: MicroBatch, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded micro-batch's ids and mask with masked columns up to `padded`."""
    mask = mb.attention_mask.bool()
    extra = padded - mask.shape[1]
    return (torch.cat([mb.input_ids, mb.input_ids.new_zeros(mask.shape[0], extra)], dim=1),
            torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1))


def _causal_mask(mask: torch.Tensor) -> torch.Tensor:
    """(b, s) keep-mask -> (b, 1, s, s), True = masked out."""
    s = mask.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :]
    return ~allowed


def _split_inputs(mb: MicroBatch, multiple: int, cp_group, device) -> ModelInputs:
    """This context-parallel rank's part of the micro-batch (see the module docstring)."""
    size, rank = group_size(cp_group), group_rank(cp_group)
    if mb.position_ids is not None:
        length = mb.position_ids.shape[1]
        bounds = _packed_bounds(mb.position_ids[0])
        padded = cp.pad_sequences(bounds, size, multiple)
        # Where each token of the micro-batch goes in the padded row, sequence by sequence.
        offset = torch.tensor([new - old for old, new in zip(bounds[:-1], padded)])
        target = torch.arange(length) + offset.repeat_interleave(torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1]))
        ids = mb.input_ids.new_zeros(1, padded[-1])
        ids[0, target] = mb.input_ids[0]
        pos = torch.cat([torch.arange(end - start) for start, end in zip(padded[:-1], padded[1:])])[None]
        mine = cp.local_index(padded, size, rank)
        value_index = cp.gathered_position(padded, size)[target]
        return ModelInputs(ids[:, mine].to(device), pos[:, mine].to(device), None, _thd_params(padded, device),
                           length, cp_group, value_index)
    length = mb.attention_mask.shape[1]
    s = round_up(length, 2 * size * multiple)
    ids, mask = _pad_columns(mb, s)
    mine = cp.chunk_positions(s, size, rank)
    positions = mine[None].expand(ids.shape[0], -1)
    # This rank's query rows against every key, in sequence order (attention.py gathers the keys).
    attention_mask = _causal_mask(mask)[:, :, mine]
    value_index = cp.gathered_position([0, s], size)[:length]
    return ModelInputs(ids[:, mine].to(device), positions.to(device), attention_mask.to(device), None, length,
                       cp_group, value_index)
