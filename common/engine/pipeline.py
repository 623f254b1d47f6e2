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

At export the transforms run backwards (common.engine.transforms.export_state_dict): the HF export is the
plain critic whatever the pipeline added. This module decides the transform stage's order; it may
import common's transform implementations (transforms, lora), nothing above them.
"""

from __future__ import annotations


def engine_transforms(config) -> list:
    """The transforms an engine with EngineConfig `config` applies, in order: engine.transforms,
    then LoRA when engine.lora.rank > 0 (names or ModelTransforms, for apply_transforms)."""
    items = list(config.transforms)
    if config.lora.rank:
        from .lora import lora_transform

        items.append(lora_transform(config.lora))
    return items
