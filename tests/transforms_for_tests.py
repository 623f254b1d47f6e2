"""A transform that adds a parameter, registered by tests: the head's output times a learned scale
(starting at 1), folded back into the head at export."""

import torch

from critic_adapters.common.engine.transforms import TRANSFORMS, ModelTransform, register_transform
from critic_adapters.common.valuehead.config import critic_head


class ScaledHead(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * self.scale


def _scale_head(model):
    head = critic_head(model)
    head.__class__ = ScaledHead
    head.scale = torch.nn.Parameter(torch.ones(1, device=head.weight.device, dtype=head.weight.dtype))


def _fold_scale(state):
    prefix = next(k for k in state if k.endswith(".scale")).removesuffix("scale")
    scale = state.pop(prefix + "scale")
    state[prefix + "weight"] = state[prefix + "weight"] * scale
    if prefix + "bias" in state:
        state[prefix + "bias"] = state[prefix + "bias"] * scale
    return state


def register_test_transforms():
    if "scaled_head" not in TRANSFORMS:
        register_transform("scaled_head", ModelTransform(apply=_scale_head, to_plain=_fold_scale,
                                                         doc="a learned scale on the head (tests)"))
