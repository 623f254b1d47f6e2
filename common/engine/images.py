"""A vision-language critic's images in an engine: checked on every rank together, then laid out
with each micro-batch (common.valuehead.multimodal does the per-row work)."""

from __future__ import annotations

import torch

from ..parallel.batching import MicroBatch
from ..parallel.distributed import all_reduce
from ..parallel.ulysses import VISION_REFUSAL as ULYSSES_REFUSAL  # noqa: F401 - the engines' name for it
from ..valuehead import multimodal



def checked_images(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, multi_modal_inputs, *,
                   group, ulysses: bool = False) -> tuple | None:
    """The rows' images (multimodal.as_rows) after multimodal.check_rows, raised on every rank of
    `group` together (one rank raising alone would leave the others in a collective)."""
    problem = None
    try:
        rows = multimodal.as_rows(multi_modal_inputs, input_ids.shape[0])
        if rows is not None and ulysses:
            raise ValueError(ULYSSES_REFUSAL)
        multimodal.check_rows(config, input_ids, attention_mask, rows)
    except ValueError as error:
        problem, rows = error, None
    (anywhere,) = all_reduce([float(problem is not None)], op="max", group=group)
    if problem is not None:
        raise problem
    if anywhere:
        raise ValueError("another rank's multi_modal_inputs do not match its rows (its error names the row); "
                         "no forward was run")
    return rows


def lay_out_images(model: torch.nn.Module, micro_batch: MicroBatch, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, images: tuple | None) -> MicroBatch:
    """The micro-batch with its rows' images and multimodal positions; as it is without images. A
    vision critic lays out text-only rows too when the batch has images elsewhere (their positions
    are plain), so that every micro-batch of a vision critic runs the same way."""
    if images is None:
        return micro_batch
    return multimodal.lay_out(model, micro_batch, input_ids, attention_mask, images)
