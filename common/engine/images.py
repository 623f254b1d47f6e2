"""A vision-language critic's images in an engine: checked on every rank together, then laid out
with each micro-batch (common.valuehead.multimodal does the per-row work)."""

from __future__ import annotations

import dataclasses

import torch

from ..parallel.batching import MicroBatch
from ..parallel.distributed import all_reduce
from ..valuehead import multimodal



@dataclasses.dataclass(frozen=True, slots=True)
class Images:
    """This rank's rows' images, and which kinds any rank of the group has (every micro-batch then
    runs the vision tower for them: multimodal.with_placeholder_media)."""

    rows: tuple | None
    anywhere: frozenset


NONE = Images(None, frozenset())


def checked_images(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, multi_modal_inputs, *,
                   group) -> Images:
    """The rows' images (multimodal.as_rows) after multimodal.check_rows, raised on every rank of
    `group` together (one rank raising alone would leave the others in a collective)."""
    problem, kinds = None, set()
    try:
        rows = multimodal.as_rows(multi_modal_inputs, input_ids.shape[0])
        multimodal.check_rows(config, input_ids, attention_mask, rows)
        kinds = set().union(*(multimodal.media_kinds(row) for row in rows)) if rows is not None else set()
    except ValueError as error:
        problem, rows = error, None
    flags = [float(problem is not None)] + [float(kind in kinds) for kind in MEDIA]
    anywhere, *has = all_reduce(flags, op="max", group=group)
    if problem is not None:
        raise problem
    if anywhere:
        raise ValueError("another rank's multi_modal_inputs do not match its rows (its error names the row); "
                         "no forward was run")
    return Images(rows, frozenset(kind for kind, flag in zip(MEDIA, has) if flag))


MEDIA = ("image", "video")


def lay_out_images(model: torch.nn.Module, micro_batch: MicroBatch, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, images: Images, *, sharded: bool) -> MicroBatch:
    """The micro-batch with its rows' images and multimodal positions; as it is when no rank has
    images. `sharded` (the vision tower's parameters are gathered over ranks when it runs): a
    micro-batch missing a kind that another rank has gets a placeholder of it, so every rank runs
    the tower as often, in the same order (multimodal.with_placeholder_media)."""
    if images.rows is not None:
        micro_batch = multimodal.lay_out(model, micro_batch, input_ids, attention_mask, images.rows)
    missing = images.anywhere - multimodal.media_kinds(micro_batch.model_inputs)
    if sharded and missing:
        micro_batch = multimodal.with_placeholder_media(model, micro_batch, missing)
    return micro_batch
