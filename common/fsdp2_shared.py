"""What the two backends built on torch's FSDP2 (fsdp, veomni) share: DCP checkpoints, their size,
and the forward of one micro-batch.

A checkpoint directory holds the DCP shards of model + optimizer, `trainer_state.pt` (scheduler,
the engine's own RNG, the caller's extra state such as the data position) and
`critic_checkpoint.json` (the critic's fingerprint, written last). Staging, the all-ranks-or-none
commit and the fingerprint are common/checkpoints.py's. DCP reshards on load: a checkpoint from 2
ranks loads on 1 and vice versa. An engine passed here has `model`, `optimizer`, `scheduler`,
`generator`, `dp_rank`, `dp_size` and `dp_group`.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .batching import MicroBatch
from .checkpoints import check_meta, hf_fingerprint, staged_checkpoint, write_meta
from .distributed import all_reduce
from .valuehead.values import compute_values

TRAINER_STATE = "trainer_state.pt"


def fingerprint(model: torch.nn.Module) -> dict:
    """The critic's fingerprint: HF parameter names with their full (unsharded) shapes."""
    return hf_fingerprint(model.config, ((name, tuple(p.shape)) for name, p in model.named_parameters()))


def save_checkpoint(directory: str, engine, extra_state: dict, *, backend: str) -> None:
    """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole)."""
    model, optimizer = engine.model, engine.optimizer
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    main = engine.dp_rank == 0
    with staged_checkpoint(directory, is_main=main, group=engine.dp_group) as staging:
        dcp.save(state, checkpoint_id=staging, process_group=engine.dp_group)  # the ranks FSDP shards over
        if main:
            torch.save({"scheduler": engine.scheduler.state_dict(), "rng": engine.generator.get_state(),
                        "extra": extra_state}, os.path.join(staging, TRAINER_STATE))
            write_meta(staging, fingerprint(model), world_size=engine.dp_size, backend=backend)


def load_checkpoint(directory: str, engine) -> dict:
    """Restore model, optimizer, scheduler and the engine's RNG in place; returns the saved extra state."""
    model, optimizer = engine.model, engine.optimizer
    check_meta(directory, fingerprint(model))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=directory, process_group=engine.dp_group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    trainer_state = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=True)
    engine.scheduler.load_state_dict(trainer_state["scheduler"])
    engine.generator.set_state(trainer_state["rng"])
    return trainer_state["extra"]


def checkpoint_bytes(engine) -> int:
    """About how many bytes save_checkpoint writes (all ranks): model and optimizer state, plus 1 MiB."""
    tensors = list(engine.model.parameters())
    tensors += [v for state in engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    shards = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    local = sum(s.numel() * s.element_size() for s in shards)
    (total,) = all_reduce([float(local)], group=engine.dp_group)
    return int(total) + 2**20


@contextlib.contextmanager
def quiet_fsdp_views():
    # FSDP2 warns that a wrapped module returns a view (the head's output): harmless here, as values
    # are never modified in place. Scoped, so the process's warning filters stay as they were.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        yield


def forward_micro_batch(model: torch.nn.Module, mb: MicroBatch, row_length: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(values of the micro-batch's rows laid out [len(rows), row_length], the raw model output)."""
    with quiet_fsdp_views():
        values = compute_values(
            model,
            mb.input_ids.to(device),
            None if mb.attention_mask is None else mb.attention_mask.to(device),
            None if mb.position_ids is None else mb.position_ids.to(device),
        )
    return mb.unpack(values, row_length), values
