"""Per-sequence causal attention for packed rows on any device: `critic_packed_sdpa`.

Packed rows (several sequences concatenated, position ids restarting at 0) must not attend across
sequences. flash-attention's varlen kernels do this on CUDA. Without them, transformers can build
a block-diagonal mask for sdpa, but that attends over the whole N x N row, wasting work that grows
with the number of sequences packed together. This implementation runs sdpa with is_causal on each
sequence's span instead (batched over spans of equal length), so the cost is sum(L_i^2) as for
padded rows — with none of the padding.

Registered under ATTENTION_NAME with transformers' AttentionInterface; its mask function refuses
padding masks, because this attention only ever sees position ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "critic_packed_sdpa"


def segment_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each sequence in one packed row (a new one starts wherever position is 0)."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return list(zip(starts, starts[1:] + [position_ids.numel()]))


def _causal_window_mask(length: int, window: int, device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, N, D), key/value (B, Hkv, N, D) -> (B, N, Hq, D), as transformers expects."""
    assert attention_mask is None, "critic_packed_sdpa never receives a mask (see _refuse_padding_mask)"
    batch, _, length, _ = query.shape
    dropout = dropout if module.training else 0.0
    gqa = key.shape[1] != query.shape[1]

    def attend(q, k, v, span):
        if sliding_window is not None and span > sliding_window:
            mask = _causal_window_mask(span, sliding_window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling,
                                              enable_gqa=gqa)

    rows = []
    for b in range(batch):
        spans = segment_bounds(position_ids[b]) if position_ids is not None else [(0, length)]
        by_length: dict[int, list[int]] = {}
        for start, end in spans:
            by_length.setdefault(end - start, []).append(start)
        pieces: dict[int, torch.Tensor] = {}  # span start -> (H, L, D) output
        for span, starts in by_length.items():
            if len(starts) == 1:  # a slice is a view: no gather needed
                s0 = starts[0]
                pieces[s0] = attend(query[b:b + 1, :, s0:s0 + span], key[b:b + 1, :, s0:s0 + span],
                                    value[b:b + 1, :, s0:s0 + span], span)[0]
                continue
            # Several spans of one length run as a single batched call: (S, H, L, D).
            index = (torch.tensor(starts, device=query.device)[:, None]
                     + torch.arange(span, device=query.device)).flatten()
            shape = (len(starts), span)
            q, k, v = (t[b][:, index].unflatten(1, shape).transpose(0, 1) for t in (query, key, value))
            out = attend(q, k, v, span)
            for i, s0 in enumerate(starts):
                pieces[s0] = out[i]
        rows.append(torch.cat([pieces[s0] for s0 in sorted(pieces)], dim=1))
    out = torch.stack(rows) if batch > 1 else rows[0][None]
    return out.transpose(1, 2).contiguous(), None


def _refuse_padding_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"{ATTENTION_NAME} runs on packed rows only (attention per sequence from position_ids); got a "
            f"padding attention_mask. Pack the rows (common.batching.pack) or load the model with sdpa."
        )
    return None


def register() -> str:
    """Make ATTENTION_NAME known to transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _refuse_padding_mask)
    return ATTENTION_NAME
