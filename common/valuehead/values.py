"""compute_values: per-token scalar values from a critic, never touching a vocab projection."""

from __future__ import annotations

import torch


def is_packed(position_ids: torch.Tensor) -> bool:
    """True when position ids restart at 0 inside a row: several sequences packed into one row."""
    return bool((position_ids[..., 1:] == 0).any())


def compute_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values [B, T] in float32 (even for a bf16 model); the value for token t is read at position t.

    Callers shift: the value of response token t is conventionally read at t-1 (verl, OpenRLHF,
    trl, NeMo-RL all do), so converting formats never reindexes.

    Packed rows (position_ids restarting at 0 per sequence, from common.batching) are run with
    attention_mask=None and no cache: transformers then builds a per-sequence (block-diagonal)
    mask from position_ids. A 2-D mask would let packed sequences attend to each other, so it is
    refused unless it is all ones.
    """
    if position_ids is not None and is_packed(position_ids):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "packed rows (position_ids restart at 0) cannot take a padding attention_mask: a 2-D mask "
                "would mix the packed sequences. Pass attention_mask=None for packed rows."
            )
        attention_mask = None
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return output.logits.squeeze(-1).float()  # (B, T, 1) -> (B, T)
