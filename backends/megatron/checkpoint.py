"""Sharded, atomic, resumable checkpoints with megatron's dist_checkpointing, and the HF export.

A checkpoint directory holds the dist_checkpointing shards of model + optimizer (global tensors:
any tensor/pipeline layout reloads them, so a TP2 checkpoint resumes at TP1 and back),
`trainer_state.pt` (common.storage.checkpoints.save_trainer_state) and
`critic_checkpoint.json` (the HF critic's fingerprint, independent of the parallel layout), written
last. Staging, the all-ranks-or-none commit and the fingerprint are common/storage/checkpoints.py's.
"""

from __future__ import annotations

import functools

from megatron.core import dist_checkpointing

from . import compat
from ...common.storage.checkpoints import (
    check_meta,
    load_trainer_state,
    save_trainer_state,
    staged_checkpoint,
    write_meta,
)
from ...common.parallel.distributed import one_outcome


def _sharded_state(ddp_model, optimizer, *, is_loading: bool) -> dict:
    """Model and optimizer as dist_checkpointing tensors; when some parameters are frozen (LoRA), the
    model part holds only the trainable ones (the frozen base comes from engine.model.path, pinned by
    the fingerprint)."""
    model_state = ddp_model.module.sharded_state_dict()
    params = dict(ddp_model.module.named_parameters())
    if not all(p.requires_grad for p in params.values()):
        model_state = {key: value for key, value in model_state.items()
                       if key in params and params[key].requires_grad}
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def save_checkpoint(directory: str, engine, extra_state: dict) -> None:
    """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole);
    a failure on any rank raises on every rank (common.storage.checkpoints.staged_checkpoint)."""
    state = _sharded_state(engine.model, engine.optimizer, is_loading=False)
    main = engine.dist.is_main
    with staged_checkpoint(directory, is_main=main, group=engine.parallel.world_group,
                           timeout_s=engine.config.collective_timeout_s) as staging:
        with compat.cuda_to_cpu(), compat.in_process_save_results():
            dist_checkpointing.save(state, staging)
        if main:
            save_trainer_state(staging, engine, extra_state)
            write_meta(staging, engine.fingerprint, world_size=engine.dist.world_size, backend="megatron")


def load_checkpoint(directory: str, engine) -> dict:
    """Restore model, optimizer, schedule and the engine's RNG in place (any parallel layout); returns
    the extra state."""
    # Every rank reads the files itself: all agree on what they found before the collective load (a
    # rank that refused alone would leave the others in it), and on how the load went after it.
    agreed = functools.partial(one_outcome, group=engine.parallel.world_group,
                               timeout_s=engine.config.collective_timeout_s)
    with agreed(f"loading checkpoint {directory}"):
        meta = check_meta(directory, engine.fingerprint)
        if meta.get("backend") != "megatron":
            raise ValueError(f"{directory} was written by the {meta.get('backend', 'fsdp')} backend; resume it with "
                             f"that backend, or start a new run from its hf_export")
    with agreed(f"loading checkpoint {directory}"):
        state = _sharded_state(engine.model, engine.optimizer, is_loading=True)
        with compat.cuda_to_cpu():
            loaded = dist_checkpointing.load(state, directory)
            engine.model.module.load_state_dict(loaded["model"], strict=False)
            engine.optimizer.load_state_dict(loaded["optimizer"])
        extra = load_trainer_state(directory, engine)
    return extra
