"""Ulysses sequence parallelism (DeepSpeed-Ulysses) for Hugging Face critics: the fsdp and veomni
engines' `engine.parallel.ulysses = N`.

Each rank of a sequence-parallel group of N holds 1/N of a micro-batch's columns (`SequenceSplit`):
embeddings, MLPs, norms and the value head run on that slice alone. In attention an all-to-all
turns "every head, 1/N of the sequence" into "1/N of the heads, the whole sequence", the usual
attention runs on it — packed rows per sequence (common/parallel/packed_attention.py), padded rows with
their padding mask — and a second all-to-all turns it back. The values are gathered back to whole
rows, so the loss is computed as without SP (the same on every rank of the group).

What the attention needs beyond its slice (where the packed sequences start in the whole row, or
the whole row's padding mask) is held by the split of the micro-batch in flight (`active`): set
around forward *and* backward, because gradient checkpointing recomputes attention during the
backward, possibly on autograd's own thread (so it is a plain module global, not a contextvar).

Registered under ATTENTION_NAME with transformers' AttentionInterface; position ids are the whole
row's (each rank passes its slice of them), so rotary embeddings are those of the unsplit row.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import packed_attention
from .batching import MicroBatch
from .sdpa import sdpa
from .sequence_parallel import all_to_all, gather_sequence, group_rank, group_size, round_up

ATTENTION_NAME = "critic_ulysses_attention"


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceSplit:
    """One micro-batch's columns split over a sequence-parallel group."""

    group: object
    size: int
    rank: int
    length: int
    """Columns of the micro-batch before padding to a multiple of `size`."""
    input_ids: torch.Tensor
    """This rank's columns (B, n)."""
    position_ids: torch.Tensor
    """This rank's slice of the whole row's positions (B, n)."""
    spans: list[list[tuple[int, int]]] | None
    """Packed rows: each row's sequence spans over the whole (padded) row."""
    key_mask: torch.Tensor | None
    """Padded rows: the whole row's padding mask (B, N) bool (True = a real token)."""

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's outputs (B, n, ...) -> the whole micro-batch's (B, length, ...)."""
        return gather_sequence(local, self.group, dim=1)[:, : self.length]


def split_micro_batch(mb: MicroBatch, group) -> SequenceSplit:
    """This rank's share of `mb`'s columns. The row is padded to a multiple of the group size: packed
    rows with one dummy sequence (positions restarting at 0), padded rows with masked columns."""
    size, rank = group_size(group), group_rank(group)
    ids = mb.input_ids
    length = ids.shape[1]
    padded = round_up(max(length, 1), size)
    extra = padded - length
    if mb.position_ids is not None:  # packed
        positions = torch.cat([mb.position_ids, torch.arange(extra)[None].expand(ids.shape[0], extra)], dim=1)
        spans = [packed_attention.segment_bounds(row) for row in positions]
        key_mask = None
    else:
        mask = mb.attention_mask.bool()
        key_mask = torch.cat([mask, mask.new_zeros(ids.shape[0], extra)], dim=1)
        # transformers' positions for padded rows without position ids: the column index.
        positions = torch.arange(padded)[None].expand(ids.shape[0], padded)
        spans = None
    ids = torch.cat([ids, ids.new_zeros(ids.shape[0], extra)], dim=1)
    n = padded // size
    local = slice(rank * n, (rank + 1) * n)
    return SequenceSplit(group, size, rank, length, ids[:, local], positions[:, local].contiguous(), spans, key_mask)


_ACTIVE: list[SequenceSplit] = []


@contextlib.contextmanager
def active(split: SequenceSplit):
    """Within this block (forward and backward of one micro-batch), Ulysses attention reads `split`."""
    _ACTIVE.append(split)
    try:
        yield split
    finally:
        _ACTIVE.remove(split)


def check_heads(num_heads: int, num_kv_heads: int, degree: int) -> None:
    """ValueError naming the numbers when `degree` ranks cannot split these attention heads."""
    if num_heads % degree:
        raise ValueError(f"engine.parallel.ulysses={degree} must divide the model's {num_heads} attention heads "
                         f"(each rank attends with 1/{degree} of them); use a degree that divides {num_heads}")
    if num_kv_heads % degree and degree % num_kv_heads:
        raise ValueError(f"engine.parallel.ulysses={degree} and the model's {num_kv_heads} key/value heads: one must "
                         f"divide the other (fewer KV heads than ranks are replicated); use a degree that divides "
                         f"{num_kv_heads} or a multiple of it that divides {num_heads}")


IMAGES_REFUSAL = (
    "images under engine.parallel.ulysses > 1: Ulysses splits each row's tokens across ranks before the model "
    "runs, and a vision critic scatters every image's features into its placeholder tokens inside the forward, "
    "which then sit on other ranks (and its multimodal rope positions are per sequence). A vision critic's text "
    "rows run under Ulysses; give rows with images to an engine at engine.parallel.ulysses=1 (long rows fit "
    "with packing, gradient checkpointing and more data-parallel ranks)")


def check_images(degree: int, has_images: bool) -> None:
    """Refuse images (any rank's: the caller agreed on it over the ranks) under a Ulysses degree > 1."""
    if degree > 1 and has_images:
        raise ValueError(IMAGES_REFUSAL)


def check_attention(engine_config) -> None:
    """With engine.parallel.ulysses > 1 the attention is ours (ATTENTION_NAME): another explicit
    engine.model.attn_implementation is refused."""
    chosen, degree = engine_config.model.attn_implementation, engine_config.parallel.ulysses
    if degree > 1 and chosen not in (None, ATTENTION_NAME):
        raise ValueError(f"engine.model.attn_implementation={chosen!r} cannot split heads across ranks: with "
                         f"engine.parallel.ulysses={degree} leave it unset (the engine uses {ATTENTION_NAME})")


def check_layout(model_config, engine_config, world_size: int) -> None:
    """A BackendSpec check_layout (fsdp, veomni): refuse, before any process starts, a Ulysses
    degree the model's attention heads cannot be split by, or an attention that cannot split them.
    A vision-language critic builds (its text rows run under Ulysses); images are refused where
    they are given (check_images)."""
    check_attention(engine_config)
    degree = engine_config.parallel.ulysses
    if degree > 1:
        text = model_config.get_text_config()
        heads = text.num_attention_heads
        check_heads(heads, getattr(text, "num_key_value_heads", None) or heads, degree)


def _replicate_kv(t: torch.Tensor, degree: int) -> torch.Tensor:
    """(B, Hkv, n, D) with Hkv < degree -> (B, degree, n, D): each KV head repeated for the ranks
    whose query heads read it (rank r's query heads all fall in KV group r // (degree // Hkv))."""
    heads = t.shape[1]
    return t if heads % degree == 0 else t.repeat_interleave(degree // heads, dim=1)


def _padded_attention(query, key, value, key_mask, *, dropout, scaling, sliding_window, softcap):
    """q (B, h, N, D), k/v (B, g, N, D) over whole padded rows -> (B, N, h, D). The boolean mask
    keeps CUDA off flash, so grouped K/V heads are repeated there (common.parallel.sdpa)."""
    if softcap is not None:
        raise ValueError("Ulysses over padded rows does not take attention logit soft-capping (gemma2): pack the "
                         "rows (engine.batching.packing=true)")
    length = query.shape[2]
    i = torch.arange(length, device=query.device)
    allowed = i[:, None] >= i[None, :]
    if sliding_window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < sliding_window)
    keep = allowed[None, None] & key_mask.to(query.device)[:, None, None, :]
    # A padded query may see nothing (NaN): let it see itself; its output is never read.
    keep = keep | torch.eye(length, dtype=torch.bool, device=query.device)
    out = sdpa(query, key, value, attn_mask=keep, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, n, D), key/value (B, Hkv, n, D), this rank's columns -> (B, n, Hq, D)."""
    if not _ACTIVE:
        raise RuntimeError(f"{ATTENTION_NAME} runs inside common.parallel.ulysses.active(split): a model loaded with it is "
                           f"run by an engine with engine.parallel.ulysses > 1, not called directly")
    split = _ACTIVE[-1]
    assert query.shape[2] == split.input_ids.shape[1], \
        f"attention got {query.shape[2]} columns, the split in flight holds {split.input_ids.shape[1]}"
    check_heads(query.shape[1], key.shape[1], split.size)
    key, value = _replicate_kv(key, split.size), _replicate_kv(value, split.size)
    # Heads scattered, sequence gathered: (B, H/N, N n, D).
    q, k, v = (all_to_all(t, split.group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    dropout = dropout if module.training else 0.0
    if split.spans is not None:
        with packed_attention.stated_bounds(split.spans):
            out, _ = packed_attention.packed_attention(module, q, k, v, None, dropout=dropout, scaling=scaling,
                                                       sliding_window=sliding_window, softcap=softcap)
    else:
        out = _padded_attention(q, k, v, split.key_mask, dropout=dropout, scaling=scaling,
                                sliding_window=sliding_window, softcap=softcap)
    # (B, N n, H/N, D): sequence scattered back, heads gathered.
    return all_to_all(out, split.group, scatter_dim=1, gather_dim=2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None  # the attention takes the whole row's mask from the split, never transformers' local one


def register() -> str:
    """Make ATTENTION_NAME known to transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
