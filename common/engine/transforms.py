"""Model transforms: the step between loading a critic and parallelising it (torchtitan's
ModelConverter), where a list of named transforms rewrites the critic (freezing; LoRA, lora.py).

A transform rewrites an HF-named critic module in place: it may add or replace modules and freeze
parameters. Every rank applies it to its own copy (rank 0 to the loaded critic, the others to the
meta tree they shard), so it must be deterministic in what it builds; a parameter it adds starts
from values it sets on the loaded copy (rank 0's are broadcast). Optimizers are built from the
trainable parameters only (`trainable_parameters`). At export, each transform's `to_plain` maps
the full state dict back to the plain critic's (fold an adapter in, drop what it added), last
transform first, so `export_hf` always writes a plain *ForTokenClassification. The checkpoint
fingerprint records the transforms and which parameters they left trainable
(common.storage.checkpoints.critic_fingerprint).

engine.transforms names them, in order; `register_transform(name, transform)` adds one. What an
engine applies, in which order, is common.engine.pipeline.engine_transforms (LoRA, common/engine/lora.py, is one
of them). Wherever a list of transforms is taken, an item is a registered name or a ModelTransform
itself. This module imports no transform's implementation: lora.py imports it, not the reverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..valuehead.config import critic_head
from ..valuehead.multimodal import vision_tower


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelTransform:
    apply: Callable[[torch.nn.Module], None]
    """Rewrite the critic in place (before any sharding; on the meta device on most ranks)."""
    to_plain: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """The plain critic's full state dict from the transformed one's; None when the keys are unchanged."""
    doc: str = ""
    name: str = ""
    """How the checkpoint fingerprint names it (a registered transform: its registry name)."""


def _freeze(params) -> None:
    for p in params:
        p.requires_grad_(False)


def _freeze_embeddings(model: torch.nn.Module) -> None:
    _freeze(model.get_input_embeddings().parameters())


def _freeze_backbone(model: torch.nn.Module) -> None:
    head = set(id(p) for p in critic_head(model).parameters())
    _freeze(p for p in model.parameters() if id(p) not in head)


def _freeze_vision(model: torch.nn.Module) -> None:
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"engine.transforms names freeze_vision, but {type(model).__name__} "
                         f"({model.config.model_type}) has no vision tower: drop it for a text-only critic")
    _freeze(tower.parameters())


TRANSFORMS: dict[str, ModelTransform] = {
    "freeze_embeddings": ModelTransform(apply=_freeze_embeddings,
                                        doc="train everything but the input embeddings"),
    "freeze_backbone": ModelTransform(apply=_freeze_backbone,
                                      doc="train the value head only (a linear probe on the backbone)"),
    "freeze_vision": ModelTransform(apply=_freeze_vision,
                                    doc="a vision-language critic: train everything but the vision tower "
                                        "(patch embedding, vision blocks, merger)"),
}


def register_transform(name: str, transform: ModelTransform, *, replace: bool = False) -> None:
    if name in TRANSFORMS and not replace:
        raise ValueError(f"transform {name!r} is already registered; pass replace=True to replace it")
    TRANSFORMS[name] = transform


def check_transforms(names) -> None:
    unknown = [name for name in names if name not in TRANSFORMS]
    if unknown:
        raise ValueError(f"engine.transforms names {unknown}, which are not registered; available: "
                         f"{', '.join(sorted(TRANSFORMS))}")


def resolve_transforms(items) -> list[ModelTransform]:
    """The ModelTransforms a list of registered names and ModelTransforms stands for."""
    check_transforms([item for item in items if isinstance(item, str)])
    return [TRANSFORMS[item] if isinstance(item, str) else item for item in items]


def transform_names(items) -> list[str]:
    """What the checkpoint fingerprint records for a list of transforms."""
    return [item if isinstance(item, str) else item.name for item in items]


def apply_transforms(model: torch.nn.Module, items) -> torch.nn.Module:
    """`model` rewritten by each transform in order; ValueError when it leaves nothing to train."""
    transforms = resolve_transforms(items)
    for transform in transforms:
        transform.apply(model)
    if transforms and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"engine.transforms={transform_names(items)} froze every parameter: nothing is left to train")
    return model


def export_state_dict(state: dict[str, torch.Tensor], items) -> dict[str, torch.Tensor]:
    """The plain critic's state dict from the transformed critic's (last transform first)."""
    for transform in reversed(resolve_transforms(items)):
        if transform.to_plain is not None:
            state = transform.to_plain(state)
    return state


def folds_at_export(items) -> bool:
    """Whether a transform maps the transformed critic's state to the plain one (LoRA merges its
    factors into the base weights): the export then needs the whole state at once."""
    return any(transform.to_plain is not None for transform in resolve_transforms(items))


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What an optimizer steps: the parameters a transform left trainable."""
    return [p for p in model.parameters() if p.requires_grad]
