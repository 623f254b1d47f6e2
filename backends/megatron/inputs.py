"""A common.batching MicroBatch as megatron-core GPTModel inputs.

Packed rows become THD inputs: ids (1, N), position ids restarting per sequence, and
PackedSeqParams whose cu_seqlens bound the per-sequence attention (attention.py on CPU, TE on
GPU). Padded rows get arange positions and a boolean [b, 1, s, s] mask (True = masked out), as HF
uses for padded rows. Under sequence parallelism the sequence length must divide by the tensor
degree: packed rows get one extra dummy sequence, padded rows extra masked columns; `crop` drops
them again.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ...common.batching import MicroBatch


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    """(b, s): (1, N) when packed."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """(b, 1, s, s) bool, True = masked out; None when packed."""
    packed_seq_params: PackedSeqParams | None
    length: int
    """Columns of the micro-batch before padding for sequence parallelism."""

    def crop(self, values: torch.Tensor) -> torch.Tensor:
        """(b, s) values -> (b, length): what MicroBatch.unpack expects."""
        return values[:, : self.length]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def model_inputs(mb: MicroBatch, *, multiple: int = 1, device=None) -> ModelInputs:
    """Inputs for one micro-batch; `multiple`: the sequence length must divide by it (SP)."""
    if mb.position_ids is not None:  # packed: one row of concatenated sequences
        positions = mb.position_ids[0]
        length = positions.numel()
        starts = (positions == 0).nonzero().flatten().tolist()
        bounds = starts + [length]
        padded = _round_up(length, multiple)
        ids, pos = mb.input_ids, mb.position_ids
        if padded > length:  # one dummy sequence fills the row up; its values are dropped
            extra = padded - length
            ids = torch.cat([ids, ids.new_zeros(1, extra)], dim=1)
            pos = torch.cat([pos, torch.arange(extra)[None]], dim=1)
            bounds.append(padded)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        return ModelInputs(ids.to(device), pos.to(device), None, params, length)
    mask = mb.attention_mask.bool()
    b, length = mask.shape
    padded = _round_up(length, multiple)
    ids = mb.input_ids
    if padded > length:
        ids = torch.cat([ids, ids.new_zeros(b, padded - length)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, padded - length)], dim=1)
    causal = torch.ones(padded, padded, dtype=torch.bool).tril()
    allowed = causal[None, None] & mask[:, None, None, :]  # (b, 1, s, s)
    positions = torch.arange(padded)[None].expand(b, padded)
    return ModelInputs(ids.to(device), positions.to(device), (~allowed).to(device), None, length)
