"""Per-sequence causal attention for packed rows on any device: `critic_packed_attention`.

Packed rows (several sequences concatenated, position ids restarting at 0) must not attend across
sequences. flash-attention's varlen kernels do this on CUDA. Without them, transformers can build
a block-diagonal mask for sdpa, but that attends over the whole N x N row, wasting work that grows
with the number of sequences packed together. This implementation runs sdpa with is_causal on each
sequence's span instead (batched over spans of equal length), so the cost is sum(L_i^2) as for
padded rows — with none of the padding. Grouped K/V heads go through common.parallel.sdpa, which
repeats them where CUDA's fused kernels would not take them grouped (fp32, or a sliding-window mask).

Where the sequences start is not left to each model family's plumbing: VLMs turn 2-D position ids
into 3-D mrope positions and may pass the attention none at all, which once let every packed
sequence attend to the ones before it. `compute_values` states the bounds explicitly with
`sequence_bounds(position_ids)`; the position ids the attention receives are only a fallback for
direct model calls, and 3-D ones without stated bounds are an error.

Registered under ATTENTION_NAME with transformers' AttentionInterface; its mask function refuses
padding masks, because this attention only ever sees position ids. (The name must not contain
"sdpa": transformers would then refuse it for families without sdpa support, e.g. gemma2, whose
logit soft-capping this implementation does support.)
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .sdpa import repeat_kv, sdpa

ATTENTION_NAME = "critic_packed_attention"

# Per-row [(start, end)] spans of the forward in progress, set by sequence_bounds().
_BOUNDS: contextvars.ContextVar[list[list[tuple[int, int]]] | None] = contextvars.ContextVar(
    "critic_packed_bounds", default=None)


def segment_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each sequence in one packed row (a new one starts wherever position is 0)."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return list(zip(starts, starts[1:] + [position_ids.numel()]))


@contextlib.contextmanager
def sequence_bounds(position_ids: torch.Tensor):
    """Within this block, packed attention splits row b at the restarts of position_ids[b] (B, N)."""
    assert position_ids.dim() == 2, f"expected (B, N) position ids, got {tuple(position_ids.shape)}"
    with stated_bounds([segment_bounds(row) for row in position_ids.cpu()]):
        yield


@contextlib.contextmanager
def stated_bounds(spans: list[list[tuple[int, int]]]):
    """Within this block, packed attention splits row b into spans[b] ([(start, end)])."""
    token = _BOUNDS.set(spans)
    try:
        yield
    finally:
        _BOUNDS.reset(token)


def _row_spans(b: int, length: int, position_ids: torch.Tensor | None) -> list[tuple[int, int]]:
    stated = _BOUNDS.get()
    if stated is not None:
        spans = stated[b] if len(stated) > 1 else stated[0]
        assert spans[-1][1] == length, f"stated sequence bounds end at {spans[-1][1]}, the row has {length} tokens"
        return spans
    if position_ids is None:
        return [(0, length)]
    if position_ids.dim() != 2:
        raise ValueError(
            f"{ATTENTION_NAME} got position ids of shape {tuple(position_ids.shape)} and no stated sequence "
            f"bounds; run packed rows through common.valuehead.compute_values (or wrap the call in "
            f"common.parallel.packed_attention.sequence_bounds(position_ids_2d))")
    return segment_bounds(position_ids[b])


def _causal_window_mask(length: int, window: int | None, device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    allowed = distance >= 0
    return allowed & (distance < window) if window is not None else allowed


def _softcapped_attention(q, k, v, span, scaling, window, softcap, dropout):
    """Attention with tanh logit soft-capping (gemma2), which sdpa cannot do: the eager math, per span."""
    k, v = repeat_kv(q, k, v)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    scores = scores.masked_fill(~_causal_window_mask(span, window, q.device), float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return weights @ v


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, N, D), key/value (B, Hkv, N, D) -> (B, N, Hq, D), as transformers expects."""
    assert attention_mask is None, f"{ATTENTION_NAME} never receives a mask (see _refuse_padding_mask)"
    batch, _, length, _ = query.shape
    dropout = dropout if module.training else 0.0

    def attend(q, k, v, span):
        if softcap is not None:
            return _softcapped_attention(q, k, v, span, scaling, sliding_window, softcap, dropout)
        if sliding_window is not None and span > sliding_window:
            mask = _causal_window_mask(span, sliding_window, q.device)
            return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        return sdpa(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling)

    rows = []
    for b in range(batch):
        by_length: dict[int, list[int]] = {}
        for start, end in _row_spans(b, length, position_ids):
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
            f"padding attention_mask. Pack the rows (common.parallel.batching.pack) or load the model with sdpa."
        )
    return None


def register() -> str:
    """Make ATTENTION_NAME known to transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, packed_attention)  # a dict update: idempotent
    AttentionMaskInterface.register(ATTENTION_NAME, _refuse_padding_mask)
    return ATTENTION_NAME
