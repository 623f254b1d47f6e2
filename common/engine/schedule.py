"""Learning-rate schedules: linear warmup, then constant or cosine decay."""

from __future__ import annotations

import math

import torch

from .config import OptimConfig


def lr_multiplier(step: int, config: OptimConfig) -> float:
    """LR multiplier at optimizer step `step` (0-based)."""
    warmup = config.warmup
    if step < warmup:
        return (step + 1) / warmup
    if config.lr_schedule == "constant":
        return 1.0
    total = config.total_steps
    assert total is not None, "cosine schedule needs optim.total_steps (the launcher fills it in)"
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    config.warmup  # a warmup_ratio without total_steps is refused now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config))
