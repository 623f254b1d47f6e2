"""Sharded, atomic, resumable checkpoints of the VeOmni engine with torch.distributed.checkpoint (DCP).

A checkpoint directory holds the DCP shards of model + optimizer, `trainer_state.pt` (scheduler,
the engine's own RNG, the caller's extra state such as the data position) and
`critic_checkpoint.json` (the critic's fingerprint, written last). Staging, the all-ranks-or-none
commit and the fingerprint are common/checkpoints.py's. DCP reshards on load: a checkpoint from 2
ranks loads on 1 and vice versa.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ...common.checkpoints import check_meta, hf_fingerprint, staged_checkpoint, write_meta

TRAINER_STATE = "trainer_state.pt"


def fingerprint(model: torch.nn.Module) -> dict:
    """The critic's fingerprint: HF parameter names with their full (unsharded) shapes."""
    return hf_fingerprint(model.config, ((name, tuple(p.shape)) for name, p in model.named_parameters()))


def save_checkpoint(directory: str, engine, extra_state: dict) -> None:
    """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole)."""
    model, optimizer = engine.model, engine.optimizer
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    main = engine.dp_rank == 0
    with staged_checkpoint(directory, is_main=main, group=engine.dp_group) as staging:
        dcp.save(state, checkpoint_id=staging)
        if main:
            torch.save({"scheduler": engine.scheduler.state_dict(), "rng": engine.generator.get_state(),
                        "extra": extra_state}, os.path.join(staging, TRAINER_STATE))
            write_meta(staging, fingerprint(model), world_size=engine.dp_size, backend="veomni")


def load_checkpoint(directory: str, engine) -> dict:
    """Restore model, optimizer, scheduler and the engine's RNG in place; returns the saved extra state."""
    model, optimizer = engine.model, engine.optimizer
    check_meta(directory, fingerprint(model))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    trainer_state = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=True)
    engine.scheduler.load_state_dict(trainer_state["scheduler"])
    engine.generator.set_state(trainer_state["rng"])
    return trainer_state["extra"]
