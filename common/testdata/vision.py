"""Image rows for the tiny vision-language critics (configs/qwen2_vl.json, qwen2_5_vl.json, qwen3_vl.json),
laid out as a Qwen-VL processor writes them: input_ids with the expanded placeholders (vision_start,
t*h*w / merge**2 image tokens, vision_end per image) and per row the matching pixel patches and
grid in multi_modal_inputs. No processor, tokenizer or download: random text ids and pixels."""

from __future__ import annotations

import torch

from ..valuehead.multimodal import patch_width

TEXT_IDS = (3, 900)  # random text ids stay clear of the special ids the configs put at 996-999


def placeholders(config, grid) -> int:
    t, h, w = grid
    return t * h * w // config.vision_config.spatial_merge_size ** 2


def image_row(config, grids, *, before: int, after: int, generator: torch.Generator,
              pixels: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, dict | None]:
    """(input_ids [L], multi_modal_inputs or None): `before` random text ids, each image of `grids`
    (t, h, w in patches) as vision_start + placeholders + vision_end, then `after` text ids. pixels:
    each image's [t*h*w, patch_width] patches (random normal when None)."""
    ids = [torch.randint(*TEXT_IDS, (before,), generator=generator)]
    patches = []
    for index, grid in enumerate(grids):
        n = placeholders(config, grid)
        ids.append(torch.tensor([config.vision_start_token_id] + [config.image_token_id] * n
                                + [config.vision_end_token_id]))
        count = grid[0] * grid[1] * grid[2]
        patches.append(pixels[index] if pixels is not None
                       else torch.randn(count, patch_width(config), generator=generator))
    ids.append(torch.randint(*TEXT_IDS, (after,), generator=generator))
    if not grids:
        return torch.cat(ids), None
    return torch.cat(ids), {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor([list(g) for g in grids])}


def padded(rows: list[torch.Tensor], left: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask) of 1-D rows, right-padded with 0 (left-padded: rows in `left`)."""
    width = max(row.numel() for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        span = slice(width - row.numel(), width) if index in left else slice(0, row.numel())
        ids[index, span], mask[index, span] = row, 1
    return ids, mask


def save_vision_critic(family: str, directory: str, seed: int = 0) -> str:
    """A random critic of the family's tiny config with a non-zero head (values differ per token),
    saved as load_critic reads it."""
    from . import tiny_config
    from ..valuehead._quiet import quiet_transformers
    from ..valuehead.config import critic_class, critic_config

    config = critic_config(tiny_config(family))
    torch.manual_seed(seed)
    model = critic_class(config)(config)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    torch.nn.init.normal_(model.score.bias)
    with quiet_transformers():
        model.save_pretrained(directory)
    return directory


def vision_batch(config, layout: list[list[tuple[int, int, int]]], *, seed: int, left: tuple[int, ...] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor, list[dict | None]]:
    """(input_ids, attention_mask, multi_modal_inputs) of rows with these images each ([] for a text
    row), text lengths drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    rows, images = [], []
    for grids in layout:
        before, after = (int(n) for n in torch.randint(2, 9, (2,), generator=generator))
        ids, mm = image_row(config, grids, before=before, after=after, generator=generator)
        rows.append(ids)
        images.append(mm)
    ids, mask = padded(rows, left)
    return ids, mask, images


def transformers_values(critic_dir: str, batch) -> torch.Tensor:
    """The vision critics' tests' reference: values [B, T] from transformers' own VLM backbone
    (AutoModelForImageTextToText's .model) and the saved head (score.*) of the critic in `critic_dir`,
    each row of `batch` (input_ids, attention_mask, multi_modal_inputs) run alone with a processor's
    inputs, mm_token_type_ids included."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from ..valuehead.multimodal import token_types

    backbone = AutoModelForImageTextToText.from_pretrained(critic_dir).model.eval()
    head = load_file(f"{critic_dir}/model.safetensors")
    out = torch.zeros(batch.input_ids.shape)
    with torch.no_grad():
        for row in range(batch.input_ids.shape[0]):
            valid = batch.attention_mask[row].bool()
            ids = batch.input_ids[row][valid][None]
            images = batch.multi_modal_inputs[row] if batch.multi_modal_inputs else {}
            kwargs = dict(images, mm_token_type_ids=token_types(backbone.config, ids)) if images else {}
            hidden = backbone(input_ids=ids, use_cache=False, **kwargs).last_hidden_state[0]
            out[row, valid] = (hidden @ head["score.weight"].T + head["score.bias"])[:, 0]
    return out
