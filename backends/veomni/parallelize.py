"""VeOmni's FSDP2 parallelisation, optimizer and LR schedule for the critic.

The one boundary between our EngineConfig and VeOmni's arguments: every VeOmni builder the engine
uses is called from here, with arguments translated from common.engine.config. VeOmni's parallel
state is made from the engine's mesh (mesh_state.py), never by VeOmni's init_parallel_state.
"""

from __future__ import annotations

import warnings

import torch

from . import compat
from .vision_critic import VisionCritic
from ...common.engine.config import EngineConfig, OptimConfig


def mixed_precision_config(config: EngineConfig):
    """bf16: bf16 parameters and compute (the head too: VeOmni applies one policy to every FSDP unit,
    and the root holds embeddings, final norm and head), fp32 gradient reduction; values are cast to
    fp32 after the head. An fp32 output_dtype would cast each layer's output up, and the root's bf16
    head then refuses the fp32 input."""
    from veomni.arguments.arguments_types import MixedPrecisionConfig

    if config.mixed_precision == "bf16":
        return MixedPrecisionConfig(enable=True, param_dtype="bfloat16", reduce_dtype="float32")
    return MixedPrecisionConfig(enable=False)


ONE_RANK_OFFLOAD = ("engine.cpu_offload=true on veomni with one data-parallel rank: VeOmni offloads FSDP2 shards, "
                    "and with one rank it runs without FSDP2; use 2 or more ranks, backend=fsdp (which offloads at "
                    "one rank too), or engine.cpu_offload=false")


def parallelize(model: torch.nn.Module, config: EngineConfig, *, fsdp: bool):
    """FSDP2 through VeOmni's build_parallelize_model over the ambient parallel state's shard mesh
    (mesh_state.py). The model is on meta: VeOmni materialises each rank's shards (uninitialised:
    the engine then fills them from the loaded critic); with one data-parallel rank,
    VeOmni's own FSDP-off path, or compat's on CPU."""
    from veomni.distributed.torch_parallelize import build_parallelize_model

    offload = config.cpu_offload
    if offload and not fsdp:  # check_layout refuses it first (where the world size is known)
        raise ValueError(ONE_RANK_OFFLOAD)
    if not fsdp:
        if config.mixed_precision != "none":
            warnings.warn(f"engine.mixed_precision={config.mixed_precision} is ignored with one data-parallel rank: "
                          f"VeOmni applies mixed precision through FSDP2, which it uses with 2 or more ranks",
                          stacklevel=3)
        if compat.cpu_mode():
            return compat.parallelize_one_rank(model, gradient_checkpointing=config.gradient_checkpointing)
        return build_parallelize_model(model, init_device="cuda", weights_path=None,
                                       mixed_precision=mixed_precision_config(config),
                                       enable_gradient_checkpointing=config.gradient_checkpointing,
                                       enable_reentrant=False)
    return build_parallelize_model(
        model,
        init_device="meta",
        weights_path=None,
        # Materialise only: the engine fills every parameter and buffer by name right after (VeOmni's
        # random init would be thrown away, and DTensor's random ops warn on a CPU mesh).
        should_skip_hf_weight_load=True,
        mixed_precision=mixed_precision_config(config),
        enable_gradient_checkpointing=config.gradient_checkpointing,
        enable_reentrant=False,
        basic_modules=fsdp_units(model),
        # Honoured on CPU too (FSDP2's CPUOffloadPolicy: the plumbing a GPU run takes; nothing moves),
        # as fsdp does; pinned host memory only where there is a GPU to copy to.
        enable_fsdp_offload=offload,
        fsdp_offload_pin_memory=not compat.cpu_mode(),
    )


def fsdp_units(model: torch.nn.Module) -> list[str]:
    """The class names VeOmni makes FSDP units of (with the same mixed precision), besides the root:
    the model's _no_split_modules (decoder layers; a vision critic's vision blocks too), and

      - the input embedding: VeOmni leaves the root's parameters unsharded after a forward, and a
        large vocabulary's embedding is a quarter of a 0.5B critic (the class name also takes in
        Qwen3-VL's vision position embedding);
      - a vision critic's vision tower, around its blocks: its patch embedding and mergers, which
        would otherwise stay unsharded in the root; resharded after each of its forwards.
    """
    units = [*(model._no_split_modules or []), type(model.get_input_embeddings()).__name__]
    if isinstance(model, VisionCritic):
        units.append(type(model.model.visual).__name__)
    return units


def build_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """VeOmni's AdamW (fused kernel: one pass over all parameters); Muon or bf16 state
    (engine.optim.name / state_dtype): common.engine.optimizers', the one the fsdp backend runs on the
    same FSDP2 shards (VeOmni 0.1.12 has a Muon and an AnyPrecisionAdamW of its own, with their own
    parameter split, Newton-Schulz variants and Kahan buffers: one implementation, one reference)."""
    from veomni.optim import build_optimizer as veomni_build_optimizer

    if optim.name != "adamw" or optim.state_dtype != "float32":
        from ...common.engine.optimizers import build_optimizer as critic_optimizer

        return critic_optimizer(model, optim)
    return veomni_build_optimizer(model, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                  weight_decay=optim.weight_decay, fused=True, optimizer_type="adamw")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig):
    """VeOmni's warmup + constant/cosine schedule.

    VeOmni counts warmup as a fraction of the total steps (int(total * ratio)), so the ratio is
    nudged by half a step to land on optim.warmup_steps exactly. Its warmup rises linearly from
    `lr_start`; starting at lr / warmup_steps keeps the first step from running at lr 0.
    """
    from veomni.optim import build_lr_scheduler as veomni_build_lr_scheduler

    warmup = optim.warmup
    if optim.lr_schedule == "cosine":
        assert optim.total_steps is not None, "cosine schedule needs optim.total_steps (the launcher fills it in)"
        total = optim.total_steps
    else:
        total = max(optim.total_steps or 0, warmup, 1)
    return veomni_build_lr_scheduler(
        optimizer, train_steps=total, lr=optim.lr, lr_decay_style=optim.lr_schedule,
        lr_warmup_ratio=(warmup + 0.5) / total if warmup else 0.0, lr_min=optim.min_lr_ratio * optim.lr,
        lr_start=optim.lr / warmup if warmup else 0.0)
