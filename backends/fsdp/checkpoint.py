"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory holds the DCP shards of model + optimizer, `trainer_state.pt` (scheduler,
RNG, the caller's extra state such as the data position) and `critic_checkpoint.json` (what model
it belongs to). All ranks write into a staging directory that rank 0 renames into place only when
everything is written, so an interrupted save never replaces the last good checkpoint. DCP
reshards on load: a checkpoint from 2 ranks loads on 1 and vice versa.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common.atomic_dir import atomic_directory
from common.checkpoints import META_FILE
from common.distributed import DistContext, barrier, broadcast_object

TRAINER_STATE = "trainer_state.pt"


def model_fingerprint(model: torch.nn.Module) -> dict:
    """What a checkpoint must match to load into `model`: family, sizes, and every parameter shape."""
    shapes = sorted((name, list(p.shape)) for name, p in model.named_parameters())
    config = model.config.get_text_config()
    return {
        "model_type": model.config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "shapes_sha256": hashlib.sha256(json.dumps(shapes).encode()).hexdigest(),
    }


def save_checkpoint(directory: str, model, optimizer, scheduler, extra_state: dict, dist: DistContext) -> None:
    """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole)."""
    directory = os.path.abspath(directory)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if dist.is_main:
        with atomic_directory(directory, overwrite=True) as staging:
            broadcast_object(staging)
            dcp.save(state, checkpoint_id=staging)
            torch.save({"scheduler": scheduler.state_dict(), "rng_torch": torch.get_rng_state(),
                        "rng_python": random.getstate(), "extra": extra_state}, os.path.join(staging, TRAINER_STATE))
            with open(os.path.join(staging, META_FILE), "w") as f:
                json.dump({"fingerprint": model_fingerprint(model), "world_size": dist.world_size}, f, indent=2)
            barrier()  # every rank's shards are written
    else:
        staging = broadcast_object(None)
        dcp.save(state, checkpoint_id=staging)
        barrier()
    barrier()  # the rename is done


def check_checkpoint(directory: str, model) -> dict:
    """Raise a clear ValueError unless `directory` is a complete checkpoint of this model."""
    meta_file = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_file):
        raise ValueError(f"{directory} is not a critic-adapters checkpoint (no {META_FILE}); point at a "
                         f"checkpoints/step_* directory written by this engine")
    with open(meta_file) as f:
        meta = json.load(f)
    mine = model_fingerprint(model)
    if meta["fingerprint"] != mine:
        diff = {k: (meta["fingerprint"].get(k), v) for k, v in mine.items() if meta["fingerprint"].get(k) != v}
        raise ValueError(f"checkpoint {directory} belongs to another model: (checkpoint, this model) differ in {diff}; "
                         f"use the engine.model the checkpoint was trained with, or another run_dir")
    return meta


def load_checkpoint(directory: str, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG in place; returns the saved extra state."""
    check_checkpoint(directory, model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    trainer_state = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=True)
    scheduler.load_state_dict(trainer_state["scheduler"])
    torch.set_rng_state(trainer_state["rng_torch"])
    random.setstate(trainer_state["rng_python"])
    return trainer_state["extra"]


def remove_checkpoint(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
