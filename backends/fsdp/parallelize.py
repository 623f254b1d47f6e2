"""Apply activation checkpointing, mixed precision and FSDP2 sharding to a critic, in that order.

Each decoder layer is its own FSDP unit (one all-gather per layer; a vision critic's vision blocks
too, and the rest of its vision tower one more), the scalar head another (kept
in fp32: its input is cast up, so values come out fp32 even under bf16), then the root.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ...common.valuehead.config import critic_head
from ...common.valuehead.multimodal import vision_tower


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks transformers itself never splits (`_no_split_modules`), e.g. Qwen2DecoderLayer."""
    names = set(model._no_split_modules or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    assert layers, f"{type(model).__name__} lists no decoder layer class in _no_split_modules"
    return layers


def parallelize_critic(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    mixed_precision: str,
    gradient_checkpointing: bool,
    cpu_offload: bool,
) -> torch.nn.Module:
    # 1. Activation checkpointing (non-reentrant: composes with FSDP2).
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # 2. Mixed precision: bf16 params/compute, fp32 gradient reduction; the head stays fp32.
    if mixed_precision == "bf16":
        body_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        body_policy = MixedPrecisionPolicy()
    head_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    # Pinned host memory needs CUDA: on a CPU mesh the shards stay in ordinary memory.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else None
    common = {"mesh": mesh, **({"offload_policy": offload} if offload else {})}

    # 3. FSDP2: per decoder layer (and vision block), the vision tower, the head, then the root (embeddings, final norm). On a single rank
    #    there is nothing to shard: FSDP would only copy parameters and gradients in and out, so it is
    #    applied there only for the policies it carries (mixed precision, CPU offload).
    if mesh.size() == 1 and mixed_precision == "none" and not cpu_offload:
        return model
    for layer in decoder_layers(model):  # a vision critic's vision blocks are among them
        fully_shard(layer, mp_policy=body_policy, **common)
    tower = vision_tower(model)
    if tower is not None:  # the rest of the vision tower (patch embedding, merger): one unit, gathered once
        fully_shard(tower, mp_policy=body_policy, **common)
    fully_shard(critic_head(model), mp_policy=head_policy, **common)
    fully_shard(model, mp_policy=body_policy, **common)
    return model
