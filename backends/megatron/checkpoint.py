"""Sharded, atomic, resumable checkpoints with megatron's dist_checkpointing, and the HF export.

A checkpoint directory holds the dist_checkpointing shards of model + optimizer (global tensors:
any tensor/pipeline layout reloads them, so a TP2 checkpoint resumes at TP1 and back),
`trainer_state.pt` (LR schedule, RNG, the caller's extra state) and `critic_checkpoint.json` (the
HF critic's fingerprint, independent of the parallel layout), written last. Everything goes into a
staging directory that rank 0 renames into place once complete, as the FSDP backend does.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

import torch
from megatron.core import dist_checkpointing

from backends.megatron import compat
from common.atomic_dir import atomic_directory
from common.checkpoints import META_FILE
from common.distributed import DistContext, barrier, broadcast_object
from common.valuehead import save_critic

TRAINER_STATE = "trainer_state.pt"


def model_fingerprint(critic: torch.nn.Module) -> dict:
    """What a checkpoint must match: family, sizes and every HF parameter shape (not the layout)."""
    shapes = sorted((name, list(p.shape)) for name, p in critic.named_parameters())
    config = critic.config.get_text_config()
    return {
        "model_type": critic.config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "num_parameters": sum(p.numel() for p in critic.parameters()),
        "shapes_sha256": hashlib.sha256(json.dumps(shapes).encode()).hexdigest(),
    }


def _sharded_state(ddp_model, optimizer, *, is_loading: bool) -> dict:
    model_state = ddp_model.module.sharded_state_dict()
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def save_checkpoint(directory: str, ddp_model, optimizer, scheduler, extra_state: dict, fingerprint: dict,
                    dist: DistContext) -> None:
    """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole)."""
    directory = os.path.abspath(directory)
    state = _sharded_state(ddp_model, optimizer, is_loading=False)
    if dist.is_main:
        with atomic_directory(directory, overwrite=True) as staging:
            broadcast_object(staging)
            with compat.cuda_to_cpu():
                dist_checkpointing.save(state, staging)
            torch.save({"scheduler": scheduler.state_dict(), "rng_torch": torch.get_rng_state(),
                        "rng_python": random.getstate(), "extra": extra_state}, os.path.join(staging, TRAINER_STATE))
            with open(os.path.join(staging, META_FILE), "w") as f:
                json.dump({"fingerprint": fingerprint, "world_size": dist.world_size, "backend": "megatron"}, f,
                          indent=2)
            barrier()  # every rank's shards are written
    else:
        staging = broadcast_object(None)
        with compat.cuda_to_cpu():
            dist_checkpointing.save(state, staging)
        barrier()
    barrier()  # the rename is done


def check_checkpoint(directory: str, fingerprint: dict) -> dict:
    """Raise a clear ValueError unless `directory` is a complete megatron checkpoint of this model."""
    meta_file = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_file):
        raise ValueError(f"{directory} is not a critic-adapters checkpoint (no {META_FILE}); point at a "
                         f"checkpoints/step_* directory written by this engine")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("backend") != "megatron":
        raise ValueError(f"{directory} was written by the {meta.get('backend', 'fsdp')} backend; resume it with that "
                         f"backend, or start from its hf_export")
    if meta["fingerprint"] != fingerprint:
        diff = {k: (meta["fingerprint"].get(k), v) for k, v in fingerprint.items() if meta["fingerprint"].get(k) != v}
        raise ValueError(f"checkpoint {directory} belongs to another model: (checkpoint, this model) differ in {diff}; "
                         f"use the engine.model the checkpoint was trained with, or another run_dir")
    return meta


def load_checkpoint(directory: str, ddp_model, optimizer, scheduler, fingerprint: dict) -> dict:
    """Restore model, optimizer, schedule and RNG in place (any parallel layout); returns the extra state."""
    check_checkpoint(directory, fingerprint)
    state = _sharded_state(ddp_model, optimizer, is_loading=True)
    with compat.cuda_to_cpu():
        loaded = dist_checkpointing.load(state, directory)
        ddp_model.module.load_state_dict(loaded["model"], strict=False)
        optimizer.load_state_dict(loaded["optimizer"])
    trainer_state = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=False)
    scheduler.load_state_dict(trainer_state["scheduler"])
    torch.set_rng_state(trainer_state["rng_torch"])
    random.setstate(trainer_state["rng_python"])
    return trainer_state["extra"]


def export_hf(directory: str, hf_state: dict | None, critic_class: type, hf_config) -> None:
    """Rank 0 (the one holding `hf_state`) writes the HF critic; every rank waits for it."""
    if hf_state is not None:
        critic = critic_class(hf_config)
        result = critic.load_state_dict(hf_state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        save_critic(critic, directory, overwrite=True)
    barrier()
