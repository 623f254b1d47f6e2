"""The embedded image rollout set (`data.train_path: embedded:vision`) for the tiny vision-language
critic (`engine.model.path: embedded:qwen2_vl`), generated deterministically from the seed, laid out as
a Qwen-VL processor writes rows (common.testdata.vision, no processor needed):

  prompt    2-6 random text tokens, one image (grid 1x4x4 patches: vision_start, 4 placeholders,
            vision_end), 1-4 random text tokens
  response  4-8 random text tokens (response_mask 1)
  image     each image's brightness level, uniform in [-1, 1], added to every pixel of random noise
  reward    the level, on the last token

Only the image tells the return: a critic that cannot read the pixels explains none of its variance.
`embedded:vision_zeroed` is the control: the same rows with every pixel 0 (the text and the returns
unchanged), on which a critic can only learn the mean.
"""

from __future__ import annotations

import torch

from ..testdata import tiny_config
from ..testdata.vision import TEXT_IDS, image_row, patch_width

FAMILY = "qwen2_vl"  # the ids and patch width of its tiny config (qwen2_5_vl's are the same)
GRID = (1, 4, 4)
NOISE = 1.0  # the pixels' noise around the level (a weaker signal than the level's spread takes longer to learn)


def make_vision_records(num_rollouts: int, seed: int = 0, *, zero_pixels: bool = False) -> list[dict]:
    config = tiny_config(FAMILY)
    g = torch.Generator().manual_seed(seed)
    patches = GRID[0] * GRID[1] * GRID[2]
    records = []
    for _ in range(num_rollouts):
        level = float(torch.rand(1, generator=g)) * 2 - 1
        pixels = torch.randn(patches, patch_width(config), generator=g) * NOISE + level
        before, after, answer = (int(torch.randint(low, high, (1,), generator=g))
                                 for low, high in ((2, 7), (1, 5), (4, 9)))  # text before/after the image, response
        ids, media = image_row(config, [GRID], before=before, after=after, generator=g,
                               pixels=[torch.zeros_like(pixels) if zero_pixels else pixels])
        response = torch.randint(*TEXT_IDS, (answer,), generator=g).tolist()
        prompt = ids.tolist()
        rewards = [0.0] * (len(prompt) + answer)
        rewards[-1] = level
        records.append({"input_ids": prompt + response, "response_mask": [0] * len(prompt) + [1] * answer,
                        "rewards": rewards, "multi_modal_inputs": media})
    return records


def make_zeroed_vision_records(num_rollouts: int, seed: int = 0) -> list[dict]:
    """embedded:vision with every pixel 0: the control that the critic reads the images."""
    return make_vision_records(num_rollouts, seed, zero_pixels=True)
