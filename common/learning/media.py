"""A rollout's images: the per-row field `multi_modal_inputs` of rollout files (docs/DATA.md), read from
Parquet and JSON lines alike, checked for shape and type, and split out of a processor's batch.

A row's multi_modal_inputs is null (a text row) or an object of the processor's arrays for that row:
  pixel_values         [patches, C * temporal_patch * patch * patch]   floats
  image_grid_thw       [images, 3] (t, h, w in patches)                integers > 0
  pixel_values_videos, video_grid_thw, second_per_grid_ts              the same for videos
Whether they match the row's placeholder tokens depends on the model's config, which this layer does
not know: the job checks that (common.valuehead.multimodal.check_rows) once the critic is known.
"""

from __future__ import annotations

import numpy as np
import torch

FIELD = "multi_modal_inputs"
# key: the array's dimensions (the keys of common.valuehead.multimodal.KEYS)
SHAPES = {"pixel_values": 2, "image_grid_thw": 2, "pixel_values_videos": 2, "video_grid_thw": 2,
          "second_per_grid_ts": 1}
# Per-token arrays a processor also writes; the critic derives them from input_ids, so they are dropped.
DERIVED = ("mm_token_type_ids", "token_type_ids", "images_seqlens")
# (placeholder id in the model config, grid key, pixel key) of each medium, in the processor's order.
_MEDIA = (("image_token_id", "image_grid_thw", "pixel_values"),
          ("video_token_id", "video_grid_thw", "pixel_values_videos"))


def _numbers(value) -> torch.Tensor | None:
    """A tensor of `value` (a tensor, a numpy array or nested lists), or None when it is not a
    rectangular array of numbers (ragged, strings, booleans)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        return None if tensor.dtype == torch.bool or tensor.is_complex() else tensor
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nested lists
        return None
    if array.dtype.kind not in "iuf":
        return None
    return torch.from_numpy(array if array.flags.writeable else array.copy())  # Arrow's buffers are read-only


def media_problem(value) -> tuple[dict | None, str | None]:
    """(the row's multi_modal_inputs as tensors, or None for a text row; None) or (None, what is wrong).
    Floats become float32, grids int64."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        return None, f"expected an object of the processor's arrays ({', '.join(SHAPES)}) or null, got " \
                     f"{type(value).__name__}"
    out = {}
    for key, array in value.items():
        if key in DERIVED or array is None:
            continue
        if key not in SHAPES:
            return None, f"unknown key {key!r}; it takes {', '.join(SHAPES)} (and drops {', '.join(DERIVED)})"
        tensor = _numbers(array)
        grid = key.endswith("_grid_thw")
        what = "[t, h, w] rows of integers" if grid else ("a list of numbers" if SHAPES[key] == 1
                                                           else "a list of equal-length lists of numbers")
        if tensor is None or tensor.dim() != SHAPES[key] or (grid and tensor.shape[-1] != 3):
            shape = "" if tensor is None else f" of shape {list(tensor.shape)}"
            return None, f"{key}: expected {what}, got {type(array).__name__}{shape}"
        if not torch.isfinite(tensor.double()).all():
            return None, f"{key} holds NaN/inf"
        if grid:
            if (tensor.is_floating_point() and not bool((tensor == tensor.round()).all())) or bool((tensor < 1).any()):
                return None, f"{key}: expected positive integers (t, h, w in patches), got {tensor.tolist()[:4]}"
            tensor = tensor.long()
        else:
            tensor = tensor.float()
        out[key] = tensor
    return out or None, None


def read_parquet_media(column) -> list[dict | None]:
    """The multi_modal_inputs column of a Parquet table (a struct of list<list<number>> fields) as per-row
    dicts of numpy arrays, without making a Python float of every pixel; a ragged array stays nested
    lists (media_problem names it)."""
    column = column.combine_chunks()
    fields = [column.type.field(i).name for i in range(column.type.num_fields)]
    arrays = {name: column.field(name) for name in fields}
    rows = []
    for row in range(len(column)):
        if not column[row].is_valid:
            rows.append(None)
            continue
        media = {name: _array(arrays[name][row]) for name in fields}
        rows.append({name: value for name, value in media.items() if value is not None} or None)
    return rows


def _array(scalar):
    """A list (or list of lists) Arrow value as a numpy array; None when null."""
    import pyarrow as pa

    if not scalar.is_valid:
        return None
    values = scalar.values
    if values.null_count:
        return scalar.as_py()
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
            or pa.types.is_fixed_size_list(values.type)):
        return values.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(values.type):
        width = values.type.list_size
    else:
        widths = set(values.value_lengths().to_numpy(zero_copy_only=False).tolist())
        if len(widths) > 1:
            return scalar.as_py()
        width = widths.pop() if widths else 0
    flat = values.flatten()
    if flat.null_count:
        return scalar.as_py()
    return flat.to_numpy(zero_copy_only=False).reshape(len(values), width)


def split_processor_batch(batch, config) -> list[dict]:
    """A Qwen-VL processor's batch output (`processor(text=[...], images=[...], padding=True)`: input_ids
    [B, L] and attention_mask, every image's patches concatenated in pixel_values [sum of t*h*w, C*tp*p*p]
    with image_grid_thw [images, 3], videos alike) -> per row {"input_ids": [...] (padding dropped),
    "multi_modal_inputs": that row's arrays or None}. Images go to rows in order: a row takes as many
    as its placeholder tokens (t*h*w / merge**2 each, `config`: the model's config) account for; the
    patches of image k are rows [sum of t*h*w of images before k, + t*h*w of image k) of pixel_values."""
    ids, mask = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["attention_mask"]).bool()
    merge = config.vision_config.spatial_merge_size
    rows = [{"input_ids": ids[row][mask[row]].tolist(), FIELD: {}} for row in range(ids.shape[0])]
    for token_key, grid_key, pixel_key in _MEDIA:
        if batch.get(grid_key) is None:
            continue
        grids, pixels = torch.as_tensor(batch[grid_key]), torch.as_tensor(batch[pixel_key])
        patches = grids.prod(-1)
        starts = torch.cat([patches.new_zeros(1), patches.cumsum(0)]).tolist()
        image = 0
        for index, row in enumerate(rows):
            placeholders = row["input_ids"].count(getattr(config, token_key))
            first = image
            while placeholders > 0 and image < len(grids):
                placeholders -= int(patches[image]) // merge ** 2
                image += 1
            if placeholders != 0:
                raise ValueError(f"row {index}: its {grid_key.split('_')[0]} placeholder tokens do not add up "
                                 f"to whole {grid_key} entries: pass the processor's own input_ids and {grid_key}")
            if image > first:
                row[FIELD][grid_key] = grids[first:image]
                row[FIELD][pixel_key] = pixels[starts[first]:starts[image]]
                if grid_key == "video_grid_thw" and batch.get("second_per_grid_ts") is not None:
                    row[FIELD]["second_per_grid_ts"] = torch.as_tensor(batch["second_per_grid_ts"])[first:image]
        if image != len(grids):
            raise ValueError(f"{len(grids) - image} of the batch's {len(grids)} {grid_key} entries have no "
                             f"placeholder tokens in input_ids: pass the processor's own input_ids")
    for row in rows:
        row[FIELD] = row[FIELD] or None
    return rows
