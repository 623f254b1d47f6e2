"""The one pipeline every backend runs to build its critic, in this order:

  1. load      common.valuehead.load_critic: any critic format, the head checks, the load report
               (the HL-Gauss head, engine.loss.kind=hl_gauss, is built here: the head's shape is
               part of the checkpoint format, config.critic_value_head);
  2. transform engine_transforms(config), applied in order by common.engine.transforms.apply_transforms:
               engine.transforms (freezing, a host's own), then LoRA (engine.lora.rank > 0);
  3. parallelise the backend's own: FSDP2 over the mesh's shard group (fsdp: backends/fsdp/
               sharded_load.py; VeOmni: its parallelize), or megatron's module, which follows the
               transforms (convert.follow_frozen, LoRA as megatron adapters);
  4. optimize  over the trainable parameters only (common.engine.transforms.trainable_parameters).

With several shard ranks, stages 1 and 2 run on the shard group's first rank only
(`load_on_first_rank`): every other rank builds the same tree on the meta device, applies the same
transforms, parallelises it and receives its shards tensor by tensor
(common.parallel.shard_state.broadcast_state_into) — fsdp and VeOmni alike.

At export the transforms run backwards (common.engine.transforms.export_state_dict): the HF export is the
plain critic whatever the pipeline added. This module decides the transform stage's order; it may
import common's transform implementations (transforms, lora) and the layers below the engine.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch

from ..parallel.distributed import broadcast_object
from ..parallel.shard_state import broadcast_state_into
from .transforms import apply_transforms


def engine_transforms(config) -> list:
    """The transforms an engine with EngineConfig `config` applies, in order: engine.transforms,
    then LoRA when engine.lora.rank > 0 (names or ModelTransforms, for apply_transforms)."""
    items = list(config.transforms)
    if config.lora.rank:
        from .lora import lora_transform

        items.append(lora_transform(config.lora))
    return items


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any pickling failure means "send a description instead"
        return False
    return True


def load_on_first_rank(path: str, *, group, rank: int, dtype: torch.dtype, attn_implementation: str | None,
                       load_kwargs: dict, transform: Callable[[torch.nn.Module], torch.nn.Module]):
    """(the transformed critic's full state — parameters and buffers, non-persistent ones too — on
    the group's first rank, None elsewhere; load_critic's report, on every rank). Stages 1 and 2 of
    the pipeline for a sharded build. A load the first rank refuses raises that error on every rank
    (the others would otherwise wait in the next collective)."""
    from ..valuehead import load_critic

    full_state = report = error = None
    if rank == 0:
        try:
            loaded, report = load_critic(path, torch_dtype=dtype, attn_implementation=attn_implementation,
                                         **load_kwargs)
            loaded = transform(loaded)
            full_state = dict(loaded.named_parameters(remove_duplicate=False))
            full_state.update(loaded.named_buffers(remove_duplicate=False))  # rotary inv_freq: not in a state dict
            del loaded
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error = err if _picklable(err) else RuntimeError(f"{type(err).__name__}: {err}")
    report, error = broadcast_object((report, error), group=group)
    if error is not None:
        raise error
    return full_state, report


def build_sharded(path: str, *, shard_group, shard_rank: int, device: torch.device, dtype: torch.dtype,
                  attn_implementation: str | None, load_kwargs: dict, transforms: list,
                  build_tree: Callable[[object], torch.nn.Module],
                  parallelize: Callable[[torch.nn.Module], torch.nn.Module]):
    """(the critic, load_critic's report): the pipeline's load, transform and parallelise stages for
    an engine whose parameters are sharded over `shard_group` (fsdp, VeOmni). The group's first rank
    loads and transforms the critic (load_on_first_rank); every rank builds the critic's module tree
    (`build_tree(report)`, on the meta device for a sharded build), applies the same transforms,
    parallelises it, materialises what is still on meta on `device`, and receives its part of the
    first rank's state tensor by tensor. No rank but the first holds more than its shards plus one
    tensor in flight."""
    full_state, report = load_on_first_rank(path, group=shard_group, rank=shard_rank, dtype=dtype,
                                            attn_implementation=attn_implementation, load_kwargs=load_kwargs,
                                            transform=lambda critic: apply_transforms(critic, transforms))
    model = parallelize(apply_transforms(build_tree(report), transforms))
    if any(t.is_meta for t in model.parameters()):
        model.to_empty(device=device)
    broadcast_state_into(model, full_state, group=shard_group)
    del full_state
    return model, report
