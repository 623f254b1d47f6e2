"""The job's side of rollouts with images: checked against the critic before anything is written, taken
along with their rows to every engine call, and read again on --resume (images are data: neither the
checkpoints nor the prepared rollouts hold them)."""

from __future__ import annotations

import torch

from ..learning.data import Rollouts
from ..learning.media import FIELD
from ..parallel import ulysses
from ..valuehead.multimodal import check_rows, is_vision_critic, select, vision_patches

VISION_FAMILIES = "qwen2_vl, qwen2_5_vl, qwen3_vl"


def refuse_images_for_text_critic(records: list, critic_config, source: str, model_path: str) -> None:
    """ValueError naming the rows when rollouts bring images and the critic cannot see them (before
    the rows are checked against its vocabulary, which would blame the placeholder ids instead)."""
    if critic_config is not None and is_vision_critic(critic_config):
        return
    rows = [row for row, record in enumerate(records) if isinstance(record, dict) and record.get(FIELD)]
    if rows:
        kind = "a text-only critic" if critic_config is None else f"{critic_config.model_type}, a text-only critic"
        raise ValueError(f"invalid rollouts in {source}: {len(rows)} of {len(records)} rows (row {rows[0]} first) "
                         f"bring {FIELD} (images/videos), but engine.model.path={model_path} is {kind} and cannot "
                         f"see them: use a vision-language critic ({VISION_FAMILIES}; embedded:qwen2_vl), or "
                         f"rollouts without {FIELD}")


def check_images(rollouts: Rollouts, critic_config, source: str, *, ulysses_degree: int = 1) -> None:
    """ValueError naming the row whose images do not match its placeholder tokens (their count against
    the grids, patches against the grids, a grid without pixels, placeholders without images whether
    or not any row has some, dimensions the critic's vision config fixes); the rows are the file's.
    Images under engine.parallel.ulysses > 1 are refused (text rows of a vision critic run there)."""
    if critic_config is None:  # a text-only critic: refuse_images_for_text_critic checked the rows
        return
    try:
        check_rows(critic_config, rollouts.input_ids, rollouts.attention_mask, rollouts.multi_modal_inputs)
        ulysses.check_images(ulysses_degree, rollouts.multi_modal_inputs is not None)
    except ValueError as error:
        raise ValueError(f"invalid rollouts in {source}: {error}") from None


def patches(rollouts: Rollouts, rows: torch.Tensor | None = None) -> list[int] | None:
    """Per row (of `rows`, else all), the image patches its vision tower encodes: work data-parallel
    shares count as tokens (None without images)."""
    if rollouts.multi_modal_inputs is None:
        return None
    if rows is None:
        return vision_patches(rollouts.multi_modal_inputs, len(rollouts))
    return vision_patches(select(rollouts.multi_modal_inputs, rows), len(rows))


def with_images_again(prepared: Rollouts, fresh: Rollouts, path: str, prepared_file: str) -> Rollouts:
    """The prepared rollouts of a resumed run with their images, read again from the data (`fresh`, the
    same rows in the same order); ValueError when the data no longer holds the run's rollouts."""
    if prepared.input_ids.shape != fresh.input_ids.shape or not torch.equal(prepared.input_ids, fresh.input_ids):
        raise ValueError(f"--resume: {path} no longer holds the rollouts this run started from (their token ids "
                         f"differ from {prepared_file}); a resumed run reads the images from the data again, so "
                         f"resume with the run's data")
    prepared.multi_modal_inputs = fresh.multi_modal_inputs
    return prepared
