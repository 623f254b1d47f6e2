"""Learning-rate schedules: linear warmup, then constant or cosine decay."""

from __future__ import annotations

import math

import torch

from .config import OptimConfig


def lr_multiplier(step: int, config: OptimConfig) -> float:
    """LR multiplier at optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    total = config.total_steps
    assert total is not None, "cosine schedule needs optim.total_steps (the launcher fills it in)"
    progress = min(1.0, (step - config.warmup_steps) / max(1, total - config.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config))
