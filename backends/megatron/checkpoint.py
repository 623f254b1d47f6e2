"""Sharded, atomic, resumable checkpoints with megatron's dist_checkpointing, and the HF export.

A checkpoint directory holds the dist_checkpointing shards of model + optimizer (global tensors:
any tensor/pipeline layout reloads them, so a TP2 checkpoint resumes at TP1 and back),
`trainer_state.pt` (LR schedule, the engine's RNG, the caller's extra state) and
`critic_checkpoint.json` (the HF critic's fingerprint, independent of the parallel layout), written
last. Staging, the all-ranks-or-none commit and the fingerprint are common/checkpoints.py's.
"""

from __future__ import annotations

import os

import torch
from megatron.core import dist_checkpointing

from . import compat
from ...common.checkpoints import check_meta, hf_fingerprint, staged_checkpoint, write_meta
from ...common.distributed import barrier
from ...common.valuehead import save_critic

TRAINER_STATE = "trainer_state.pt"


def fingerprint(critic: torch.nn.Module) -> dict:
    """The HF critic's fingerprint (names and shapes; the same as the FSDP backend's for one critic)."""
    return hf_fingerprint(critic.config, ((name, tuple(p.shape)) for name, p in critic.named_parameters()))


def _sharded_state(ddp_model, optimizer, *, is_loading: bool) -> dict:
    model_state = ddp_model.module.sharded_state_dict()
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def save_checkpoint(directory: str, engine, extra_state: dict) -> None:
    """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole);
    a failure on any rank raises on every rank (common.checkpoints.staged_checkpoint)."""
    state = _sharded_state(engine.model, engine.optimizer, is_loading=False)
    main = engine.dist.is_main
    with staged_checkpoint(directory, is_main=main) as staging:
        with compat.cuda_to_cpu():
            dist_checkpointing.save(state, staging)
        if main:
            torch.save({"scheduler": engine.scheduler.state_dict(), "rng": engine.generator.get_state(),
                        "extra": extra_state}, os.path.join(staging, TRAINER_STATE))
            write_meta(staging, engine.fingerprint, world_size=engine.dist.world_size, backend="megatron")


def load_checkpoint(directory: str, engine) -> dict:
    """Restore model, optimizer, schedule and the engine's RNG in place (any parallel layout); returns
    the extra state."""
    meta = check_meta(directory, engine.fingerprint)
    if meta.get("backend") != "megatron":
        raise ValueError(f"{directory} was written by the {meta.get('backend', 'fsdp')} backend; resume it with that "
                         f"backend, or start a new run from its hf_export")
    state = _sharded_state(engine.model, engine.optimizer, is_loading=True)
    with compat.cuda_to_cpu():
        loaded = dist_checkpointing.load(state, directory)
        engine.model.module.load_state_dict(loaded["model"], strict=False)
        engine.optimizer.load_state_dict(loaded["optimizer"])
    trainer_state = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=True)
    engine.scheduler.load_state_dict(trainer_state["scheduler"])
    engine.generator.set_state(trainer_state["rng"])
    return trainer_state["extra"]


def export_hf(directory: str, hf_state: dict | None, critic_class: type, hf_config) -> None:
    """Rank 0 (the one holding `hf_state`) writes the HF critic; every rank waits for it."""
    if hf_state is not None:
        critic = critic_class(hf_config)
        result = critic.load_state_dict(hf_state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        save_critic(critic, directory, overwrite=True)
    barrier()
