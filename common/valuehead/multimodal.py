"""Images and videos for vision-language critics (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the per-row inputs
as a processor writes them, checked against the placeholder tokens, and laid out for a micro-batch.

A row's multi_modal_inputs (verl's convention) is a dict of tensors, or None / {} for a text row:
  pixel_values [patches, C * temporal_patch * patch * patch], image_grid_thw [images, 3] (t, h, w in patches)
  pixel_values_videos, video_grid_thw [videos, 3], second_per_grid_ts [videos] (Qwen2.5-VL's video timing)
with input_ids already holding the expanded placeholders (t * h * w / spatial_merge_size**2
image_token_id per image, video_token_id per video), as the processor writes them.

The model needs more than that, and it is derived here rather than asked for: the 3-D multimodal
rope positions of each sequence (the family's own get_rope_index, run per sequence, so packed
sequences get the positions each would have alone), with the text positions as a fourth row in
front (transformers' Qwen-VL models read [4, B, N] position ids as text + t/h/w: the text row tells
the attention where packed sequences start). Given the positions, the model needs no mm_token_type_ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
KEYS = IMAGE_KEYS + VIDEO_KEYS
# What a processor (or a stack) also writes and the critic derives itself (per token, so it would not
# survive packing; verl's agent loop adds images_seqlens for its compute accounting): accepted and dropped.
DERIVED_KEYS = ("mm_token_type_ids", "token_type_ids", "images_seqlens")
# (kind, placeholder id in the config, grid key, pixel key)
_MEDIA = (("image", "image_token_id", "image_grid_thw", "pixel_values"),
          ("video", "video_token_id", "video_grid_thw", "pixel_values_videos"))

Rows = tuple  # of dict[str, torch.Tensor], one per row ({} for a text row)


class RowError(ValueError):
    """A problem of one row, named by its index among the rows checked: a caller that checked some of
    its own rows names it by its own index (in_rows)."""

    def __init__(self, row: int, problem: str):
        super().__init__(f"row {row}: {problem}")
        self.row, self.problem = row, problem

    def __reduce__(self):  # crosses processes (Ray actors, gloo ranks) with its fields
        return RowError, (self.row, self.problem)

    def in_rows(self, rows) -> RowError:
        """The same problem named by `rows[self.row]` (the caller's index of the row checked)."""
        return RowError(int(rows[self.row]), self.problem)


def is_vision_critic(config) -> bool:
    """The critic has a vision tower (a Qwen-VL family)."""
    return getattr(config, "vision_config", None) is not None


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The critic's vision tower (`model.visual`: patch embedding, blocks, merger), or None."""
    return getattr(getattr(model, "model", None), "visual", None)


def as_rows(multi_modal_inputs, batch_size: int) -> Rows | None:
    """Normalise a batch's multi_modal_inputs: None, or a sequence (list, tuple, numpy object array)
    of one dict-or-None per row -> a tuple of dicts of tensors ({} for a text row), or None when no
    row has any. Unknown keys are refused by name."""
    if multi_modal_inputs is None:
        return None
    if isinstance(multi_modal_inputs, Mapping):
        raise ValueError("multi_modal_inputs is one dict: pass one dict (or None) per row of input_ids "
                         "(verl's non_tensor_batch['multi_modal_inputs'] layout)")
    rows = list(multi_modal_inputs)
    if len(rows) != batch_size:
        raise ValueError(f"multi_modal_inputs has {len(rows)} entries for {batch_size} rows of input_ids: "
                         f"pass one dict (or None for a text row) per row")
    out = []
    for index, row in enumerate(rows):
        if row is None:
            out.append({})
            continue
        if not isinstance(row, Mapping):
            raise ValueError(f"multi_modal_inputs[{index}] is a {type(row).__name__}: expected a dict of the "
                             f"processor's tensors ({', '.join(KEYS)}) or None")
        unknown = sorted(set(row) - set(KEYS) - set(DERIVED_KEYS))
        if unknown:
            raise ValueError(f"multi_modal_inputs[{index}] has {', '.join(map(repr, unknown))}, which the critic "
                             f"cannot use; it takes {', '.join(KEYS)}")
        out.append({key: torch.as_tensor(value).cpu() for key, value in row.items()  # laid out on the host
                    if key in KEYS and value is not None})
    return tuple(out) if any(out) else None


def select(rows: Rows | None, index) -> Rows | None:
    """The entries of these row indices (a list or a 1-D tensor)."""
    if rows is None:
        return None
    picked = tuple(rows[int(i)] for i in index)
    return picked if any(picked) else None


def vision_patches(rows: Rows | None, batch_size: int) -> list[int]:
    """Per row, the patches its vision tower encodes (images and videos): the vision work a row adds
    to its tokens, for balancing data-parallel shares."""
    if rows is None:
        return [0] * batch_size
    return [sum(int(row[grid].prod(-1).sum()) for _, _, grid, _ in _MEDIA if grid in row) for row in rows]


def check_rows(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Rows | None) -> None:
    """ValueError naming the row when a row's images do not match its placeholder tokens (count of
    placeholders vs the grids, patches vs the grids, a grid without pixels, dimensions the vision
    config fixes), and when a text-only critic is given images. Every row of a vision critic is
    checked, `rows` None too (no images given for any row): placeholders without pixels are
    refused whether or not other rows have images, never computed blind. A row's problem is a RowError
    (a caller that checked some of its rows names them its own way: RowError.in_rows)."""
    if rows is None:
        if not is_vision_critic(config):
            return
        rows = ({},) * input_ids.shape[0]
        missing = " (no row was given multi_modal_inputs: pass each row's images, as the processor wrote them)"
    else:
        missing = ""
    if not is_vision_critic(config):
        first = next(i for i, row in enumerate(rows) if row)
        raise RowError(first, f"multi_modal_inputs gives images/videos ({sum(map(bool, rows))} row(s) have some), but "
                              f"this critic ({config.model_type}) is text-only and cannot see them: load a "
                              f"vision-language critic (qwen2_vl, qwen2_5_vl, qwen3_vl) or pass multi_modal_inputs=None")
    merge = config.vision_config.spatial_merge_size
    for index, row in enumerate(rows):
        ids = input_ids[index][attention_mask[index].bool()]
        for kind, token_key, grid_key, pixel_key in _MEDIA:
            token_id = getattr(config, token_key)
            placeholders = int((ids == token_id).sum())
            grid, pixels = row.get(grid_key), row.get(pixel_key)
            if (grid is None) != (pixels is None):
                raise RowError(index, f"multi_modal_inputs has {grid_key if grid is not None else pixel_key} "
                                 f"without {pixel_key if grid is not None else grid_key}; {'an' if kind == 'image' else 'a'} {kind} "
                                 f"needs both")
            if grid is None:
                if placeholders:
                    raise RowError(index, f"input_ids hold {placeholders} {kind} placeholder token(s) "
                                     f"(id {token_id}) but the row has no {pixel_key}{missing}")
                continue
            if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
                raise RowError(index, f"{grid_key} has shape {tuple(grid.shape)} ({grid.dtype}); expected "
                                 f"[{kind}s, 3] integers (t, h, w in patches)")
            check_grid(config, grid, grid_key, row=index)
            width = patch_width(config)
            if pixels.dim() != 2 or pixels.shape[1] != width:
                vision = config.vision_config
                raise RowError(index, f"{pixel_key} has shape {tuple(pixels.shape)}; this critic's processor "
                                 f"makes rows of {width} values (channels x temporal_patch_size "
                                 f"{vision.temporal_patch_size} x patch_size {vision.patch_size}**2): [patches, {width}]")
            if kind == "video" and "second_per_grid_ts" in row and row["second_per_grid_ts"].numel() != grid.shape[0]:
                raise RowError(index, f"second_per_grid_ts has {row['second_per_grid_ts'].numel()} entries for "
                                 f"{grid.shape[0]} video(s) in video_grid_thw: one per video")
            patches = int(grid.prod(-1).sum())
            if pixels.shape[0] != patches:
                raise RowError(index, f"{pixel_key} has {pixels.shape[0]} patch rows, {grid_key} "
                                 f"{grid.tolist()} makes {patches} (the sum of t*h*w)")
            if placeholders * merge**2 != patches:
                raise RowError(index, f"input_ids hold {placeholders} {kind} placeholder token(s) (id {token_id}) "
                                 f"but {grid_key} {grid.tolist()} makes {patches // merge**2} (t*h*w / {merge}**2 each): "
                                 f"input_ids must hold the processor's expanded placeholders for exactly this row's {kind}s")


def check_grid(config, grid: torch.Tensor, grid_key: str, *, row: int) -> None:
    """RowError for a grid [n, 3] the critic's vision config cannot have made: t, h, w positive, h and w
    multiples of spatial_merge_size (the merger folds merge x merge patches into one token)."""
    merge = config.vision_config.spatial_merge_size
    for t, h, w in grid.tolist():
        if min(t, h, w) < 1:
            raise RowError(row, f"{grid_key} has an entry [{t}, {h}, {w}]: t, h and w must be positive")
        if h % merge or w % merge:
            raise RowError(row, f"{grid_key} has an entry [{t}, {h}, {w}]: h and w must be multiples of this critic's "
                                f"spatial_merge_size {merge} (the processor resizes images to multiples of patch_size "
                                f"x {merge}); re-run the model's own processor on the image")


def token_types(config, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' mm_token_type_ids: 0 text, 1 image placeholder, 2 video placeholder."""
    return ((input_ids == config.image_token_id).int()
            + 2 * (input_ids == config.video_token_id).int())


def rope_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the family's get_rope_index (the critic's `model` backbone)."""
    for module in (getattr(model, "model", None), model):
        if module is not None and hasattr(module, "get_rope_index"):
            return module
    raise ValueError(f"{type(model).__name__} has no get_rope_index: not a Qwen-VL critic")


def sequence_positions(model: torch.nn.Module, ids: torch.Tensor, row: dict) -> torch.Tensor:
    """[3, L] multimodal rope positions of one sequence (ids [L], no padding), as the family computes them."""
    if not row:
        return torch.arange(ids.numel()).expand(3, -1)
    kwargs = {key: row[key] for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if key in row}
    positions, _ = rope_backbone(model).get_rope_index(ids[None], token_types(model.config, ids[None]), **kwargs)
    return positions[:, 0].cpu()


def model_inputs(rows: Rows, order) -> dict[str, torch.Tensor]:
    """The model's image/video kwargs for these rows in this order: their tensors concatenated."""
    picked = [rows[int(i)] for i in order]
    return {key: torch.cat([row[key] for row in picked if key in row])
            for key in KEYS if any(key in row for row in picked)}


def layout(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Rows,
           order, shape: tuple, where: tuple[torch.Tensor, torch.Tensor] | None):
    """(position_ids [4, *shape], model_inputs) for the sequences of rows `order` laid out in a
    model input of `shape`: packed into one row (where None), or at the positions `where` (row-major,
    a padded layout's valid positions). Text positions restart per sequence; the t/h/w rows are each
    sequence's own (on padding 0)."""
    text, media = [], []
    for row in order:
        ids = input_ids[row][attention_mask[row].bool()]
        text.append(torch.arange(ids.numel()))
        media.append(sequence_positions(model, ids, rows[row]))
    text, media = torch.cat(text), torch.cat(media, dim=1)
    positions = torch.zeros(4, *shape, dtype=torch.long)
    if where is None:
        positions[0, 0], positions[1:, 0] = text, media
    else:  # padded: the mask says where rows start; a text row restarting would read as packed
        positions[0] = torch.arange(shape[-1])
        positions[1:, where[0], where[1]] = media
    return positions, model_inputs(rows, order)


def media_kinds(inputs: dict | None) -> set[str]:
    """Which of "image" / "video" a micro-batch's model inputs carry."""
    return {kind for kind, _, _, pixel_key in _MEDIA if inputs and pixel_key in inputs}


def _four_rows(micro_batch) -> torch.Tensor:
    """The micro-batch's positions as [4, b, N] (a text-only micro-batch's: every row the text's)."""
    positions = micro_batch.position_ids
    if positions is not None and positions.dim() == 3:
        return positions
    if positions is None:  # padded: each row counts from its first token (left padding too)
        mask = micro_batch.attention_mask
        text = (mask.cumsum(-1) - 1).clamp(min=0)
        out = text[None].repeat(4, 1, 1)
        out[0] = torch.arange(mask.shape[-1])  # a text row restarting would read as packed
        return out
    return positions[None].repeat(4, 1, 1)


def with_placeholder_media(model: torch.nn.Module, micro_batch, kinds) -> object:
    """The micro-batch plus one more sequence of one placeholder token per kind ("image", "video"),
    each with a zero image of the smallest grid (1, merge, merge), whose outputs nothing reads.

    Why: under FSDP2 the vision tower is a unit whose parameters every rank gathers when it runs,
    and transformers runs it only for a micro-batch with images. When another rank's micro-batch
    has images and this one's has none, the ranks' collectives would no longer match (gloo aborts,
    NCCL hangs). With the placeholder the tower runs here too; its features reach no value the
    loss reads (the extra sequence is its own: packed, its own span; padded, its own row), so
    gradients are unchanged."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    patches = torch.zeros(merge * merge, patch_width(config))
    grid = torch.tensor([[1, merge, merge]])
    row, ids = {}, []
    for kind, token_key, grid_key, pixel_key in _MEDIA:
        if kind in kinds:
            ids.append(getattr(config, token_key))
            row[grid_key], row[pixel_key] = grid, patches
    ids = torch.tensor(ids)
    extra = torch.cat([torch.arange(ids.numel())[None], sequence_positions(model, ids, row)])  # [4, k]
    positions = _four_rows(micro_batch)
    inputs = dict(micro_batch.model_inputs or {})
    for key, value in row.items():
        inputs[key] = torch.cat([inputs[key], value]) if key in inputs else value
    if micro_batch.attention_mask is None:  # packed (or the empty micro-batch): one more span in row 0
        length = micro_batch.input_ids.shape[1]
        gather = micro_batch.gather_index or (torch.zeros(length, dtype=torch.long), torch.arange(length))
        input_ids = torch.cat([micro_batch.input_ids, ids[None]], dim=1)
        positions = torch.cat([positions, extra[:, None]], dim=2)
        return dataclasses.replace(micro_batch, input_ids=input_ids, position_ids=positions, model_inputs=inputs,
                                   gather_index=gather)
    b, width = micro_batch.input_ids.shape
    width2 = max(width, ids.numel())
    input_ids = torch.zeros(b + 1, width2, dtype=micro_batch.input_ids.dtype)
    mask = torch.zeros(b + 1, width2, dtype=micro_batch.attention_mask.dtype)
    grown = torch.zeros(4, b + 1, width2, dtype=torch.long)
    grown[0] = torch.arange(width2)
    input_ids[:b, :width], mask[:b, :width], grown[:, :b, :width] = micro_batch.input_ids, micro_batch.attention_mask, positions
    input_ids[b, :ids.numel()], mask[b, :ids.numel()], grown[1:, b, :ids.numel()] = ids, 1, extra[1:]
    return dataclasses.replace(micro_batch, input_ids=input_ids, attention_mask=mask, position_ids=grown,
                               model_inputs=inputs)


def patch_width(config) -> int:
    """The width of one pixel_values row: channels * temporal patch * patch * patch."""
    vision = config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
    return channels * vision.temporal_patch_size * vision.patch_size ** 2


def lay_out(model: torch.nn.Module, micro_batch, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            rows: Rows):
    """A micro-batch (common.parallel.batching.MicroBatch, packed or padded) of a vision critic, with
    its [4, b, N] position ids and its rows' images as model_inputs."""
    if not micro_batch.rows:
        return micro_batch
    positions, inputs = layout(model, input_ids, attention_mask, rows, micro_batch.rows,
                               tuple(micro_batch.input_ids.shape), micro_batch.gather_index)
    return dataclasses.replace(micro_batch, position_ids=positions, model_inputs=inputs)
