"""Sharded, atomic, resumable checkpoints with megatron's dist_checkpointing, and the HF export.

A checkpoint directory holds the dist_checkpointing shards of model + optimizer (global tensors:
any tensor/pipeline layout reloads them, so a TP2 checkpoint resumes at TP1 and back),
`trainer_state.pt` (common.storage.checkpoints.save_trainer_state) and
`critic_checkpoint.json` (the HF critic's fingerprint, independent of the parallel layout, and
which optimizer wrote the shards: `distributed_optimizer`), written last. Staging, the
all-ranks-or-none commit and the fingerprint are common/storage/checkpoints.py's.

The two optimizers (engine.optim.distributed_optimizer) save different state under different keys
(the distributed one its fp32 weights and Adam's moments per parameter, `optimizer.state.param.*`,
each rank the part it owns (optimizer_state.py), and its own step bookkeeping), so a checkpoint
resumes only with the optimizer that wrote it; the other is refused by name before anything is read.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import dist_checkpointing

from . import compat, optimizer_state, parallelize
from ...common.storage.checkpoints import (
    check_extra,
    check_optimizer_kind,
    optimizer_kind,
    check_meta,
    gather_extra_tensors,
    load_trainer_state,
    save_trainer_state,
    staged_checkpoint,
    write_meta,
)
from ...common.parallel.distributed import group_rank, one_outcome

# The plain optimizers' format (the distributed one's is optimizer_state.py's: each rank writes what
# it owns, in model space). The plain optimizers ignore the metadata.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _give_state(optimizer) -> None:
    """A distributed optimizer that has not stepped yet gets Adam's initial state (zero moments, step
    0), which torch's Adam would make at its first step. megatron-core 0.16.1's DistributedOptimizer
    reads the step count from that state to save or load a checkpoint (without TransformerEngine or
    Apex, whose Adam keeps it in the param groups) and fails on an empty one. The state is made
    megatron's way (one step on zero gradients, what its fsdp_dtensor loads do), then that step
    undone: the weights its weight decay moved put back, the step count zeroed (the moments of a
    zero gradient are zero)."""
    from megatron.core.optimizer import DistributedOptimizer

    for part in parallelize.optimizer_parts(optimizer):
        if not isinstance(part, DistributedOptimizer) or part.optimizer.state:
            continue
        params = [p for group in part.optimizer.param_groups for p in group["params"]]
        weights = [p.detach().clone() for p in params]
        part._init_optimizer_states_with_dummy_values()
        with torch.no_grad():
            for param, weight in zip(params, weights):
                param.copy_(weight)
        for state in part.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"].zero_()


def _sharded_state(ddp_model, optimizer, *, is_loading: bool) -> dict:
    """Model and optimizer as dist_checkpointing tensors; when some parameters are frozen (LoRA), the
    model part holds only the trainable ones (the frozen base comes from engine.model.path, pinned by
    the fingerprint)."""
    _give_state(optimizer)
    model_state = ddp_model.module.sharded_state_dict()
    params = dict(ddp_model.module.named_parameters())
    if not all(p.requires_grad for p in params.values()):
        model_state = {key: value for key, value in model_state.items()
                       if key in params and params[key].requires_grad}
    if optimizer_state.is_distributed(optimizer):
        return {"model": model_state, "optimizer": optimizer_state.sharded_state(optimizer, model_state)}
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                                            metadata=_OPTIMIZER_FORMAT)}


def _streaming_strategy():
    """megatron-core's torch_dist save, written tensor by tensor. Its own writer
    (FileSystemWriterAsync) stages every tensor a rank writes in host memory before writing any:
    on CPU it clones each view (every parameter is a view of DDP's buffer, every optimizer
    rectangle a view of the optimizer's state), on CUDA it copies each to the host: the rank's whole
    write set at once. torch's own FileSystemWriter with one thread takes one tensor at a time (a
    1 MB window of device-to-host copies on CUDA). Same files, same metadata, same loader."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class StreamingSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp_save(mcore_to_pyt_state_dict(sharded, False),
                     storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1),
                     planner=MCoreSavePlanner(flatten_state_dict=False, can_run_decentralized_global_plan=False))

    return StreamingSave("torch_dist", 1)


def _optimizer_name(distributed: bool) -> str:
    return "the distributed optimizer" if distributed else "the plain (replicated) optimizer"


def check_optimizer(directory: str, meta: dict, distributed: bool) -> None:
    """ValueError unless the checkpoint's optimizer state is the kind this engine's optimizer
    reads. A checkpoint whose meta does not say was written by the plain optimizer: the
    distributed one could not save before the meta recorded it (_OPTIMIZER_FORMAT)."""
    written = meta.get("distributed_optimizer", False)
    if written != distributed:
        raise ValueError(f"{directory} holds the state of {_optimizer_name(written)}, and this engine runs "
                         f"{_optimizer_name(distributed)}: resume it with engine.optim.distributed_optimizer="
                         f"{str(written).lower()}, or start a new run from its hf_export")


def save_checkpoint(directory: str, engine, extra_state: dict, extra_tensors: dict | None = None) -> None:
    """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole);
    a failure on any rank raises on every rank (common.storage.checkpoints.staged_checkpoint)."""
    check_extra(extra_state, extra_tensors)
    with compat.cuda_to_cpu():  # the distributed optimizer gathers its state with .cuda() copies
        state = _sharded_state(engine.model, engine.optimizer, is_loading=False)
    main = engine.dist.is_main
    extra = gather_extra_tensors(extra_tensors, group=engine.parallel.world_group)  # every rank's, to the writer
    with staged_checkpoint(directory, is_main=main, group=engine.parallel.world_group,
                           timeout_s=engine.config.collective_timeout_s) as staging:
        with compat.cuda_to_cpu():
            dist_checkpointing.save(state, staging, sharded_strategy=_streaming_strategy())
        if main:
            save_trainer_state(staging, engine, extra_state, extra)
            write_meta(staging, engine.fingerprint, world_size=engine.dist.world_size, backend="megatron",
                       optimizer_kind=optimizer_kind(engine.config.optim),
                       distributed_optimizer=engine.config.optim.distributed_optimizer)


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
        check_optimizer(directory, meta, engine.config.optim.distributed_optimizer)
        check_optimizer_kind(directory, meta, engine.config.optim)
    with agreed(f"loading checkpoint {directory}"):
        with compat.cuda_to_cpu(), compat.library_deprecations_quiet():
            state = _sharded_state(engine.model, engine.optimizer, is_loading=True)
            loaded = dist_checkpointing.load(state, directory)
            engine.model.module.load_state_dict(loaded["model"], strict=False)
            optimizer = loaded["optimizer"]
            if optimizer_state.is_distributed(engine.optimizer):
                optimizer = optimizer_state.loaded_state(engine.optimizer, optimizer)
            with compat.adam_step_kept():
                engine.optimizer.load_state_dict(optimizer)
        extra = load_trainer_state(directory, engine, rank=group_rank(engine.parallel.world_group),
                                   world_size=engine.parallel.world_size)
    return extra
