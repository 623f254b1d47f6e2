"""Megatron's process groups, the DDP wrapper and the optimizer, in the order the engine needs them.

  1. init_model_parallel / release_model_parallel: megatron's groups (module globals in
     megatron.core.parallel_state) set from the engine's mesh (build_mesh(..., backend="megatron")
     makes megatron's groups with it: mesh_groups.py), reused when another engine or the host
     set them with the same degrees, and the model-parallel RNG tracker (the CPU one from
     compat.py without CUDA); the last release restores what was there.
  2. wrap_ddp: megatron's DistributedDataParallel (grad buffers, the data-parallel all-reduce that
     finalize_model_grads runs, plus the tensor-parallel all-reduce of sequence-parallel norms).
     Its all-reduce spans data x context parallel and averages (1 / (dp * cp)): each context-parallel
     rank holds the gradient of its own tokens only, and the schedule multiplies every loss by the
     context-parallel degree, so the average of those is their sum, the whole gradient.
  3. build_optimizer: megatron's Adam with global grad-norm clipping across TP/PP ranks; by default
     its distributed optimizer (engine.optim.distributed_optimizer: each data-parallel rank steps
     its share of the fp32 main weights, gradients reduce-scattered into DDP's contiguous buffer and
     the parameters all-gathered back after the step), on CPU as on GPU (compat.py, shim 11).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from . import compat
from ...common.engine.config import OptimConfig, ParallelConfig
from ...common.engine.mesh import CONTEXT, DATA, PIPELINE, TENSOR, ParallelMesh, build_mesh
from ...common.parallel.distributed import groups_time_out_after

# Clipping off still needs the norm for the metrics: clip at a bound no norm reaches.
_NO_CLIP = 1.0e30


# The environment variables megatron-core sets while building a model (its attention backend).
NVTE_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@dataclasses.dataclass
class _Usage:
    """Our engines' use of megatron's process-global state, so that engines coexist with each other
    and with a host that set the state up itself, and the last close leaves it as it was found."""

    engines: int = 0
    """Our megatron engines alive in this process."""
    adopted: ParallelMesh | None = None
    """The mesh whose groups we set as parallel_state's (else the host set them, and they stay
    after our last close)."""
    environ: dict = dataclasses.field(default_factory=dict)
    """NVTE_VARIABLES as they were before the first engine was built."""
    rng_tracker: tuple | None = None
    """megatron's RNG tracker (and its initialised flag) before we installed the CPU one."""


_USAGE = _Usage()


def _check_same_layout(parallel: ParallelConfig) -> None:
    existing = {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
                "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
                "context": parallel_state.get_context_parallel_world_size(),
                "expert": parallel_state.get_expert_model_parallel_world_size()}
    wanted = {"tensor": parallel.tensor, "pipeline": parallel.pipeline, "context": parallel.context,
              "expert": parallel.expert}
    if existing != wanted:
        owner = "another megatron engine" if _USAGE.adopted is not None else "the host"
        raise ValueError(f"megatron's process groups in this process ({owner}'s) have {existing}, engine.parallel asks "
                         f"for {wanted}: megatron keeps one layout per process; use the same degrees, or close "
                         f"{owner}'s groups first")


# parallel_state's globals, each set from one of the mesh's library groups (backends/megatron/mesh_groups.py);
# a name ending in _GLOBAL_RANKS (or _RANKS) gets that group's ranks. Groups of a rank outside them stay None.
_GROUP_GLOBALS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tensor", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tensor",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pipeline", "_PIPELINE_GLOBAL_RANKS": "pipeline",
    "_MODEL_PARALLEL_GROUP": "model", "_MODEL_PARALLEL_GLOBAL_RANKS": "model",
    "_EMBEDDING_GROUP": "embedding", "_EMBEDDING_GLOBAL_RANKS": "embedding",
    "_POSITION_EMBEDDING_GROUP": "position_embedding", "_POSITION_EMBEDDING_GLOBAL_RANKS": "position_embedding",
    "_DATA_PARALLEL_GROUP": "data", "_DATA_PARALLEL_GROUP_GLOO": "data_gloo", "_DATA_PARALLEL_GLOBAL_RANKS": "data",
    "_DATA_PARALLEL_GROUP_WITH_CP": "data_context", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "data_context_gloo",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "data_context",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "data_context",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "data_context_gloo",
    "_CONTEXT_PARALLEL_GROUP": "context", "_CONTEXT_PARALLEL_GLOBAL_RANKS": "context",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tensor_data", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tensor_data_context",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tensor_context",
    # The expert grid (mesh_groups.expert_groups); expert tensor parallel = tensor parallel.
    "_EXPERT_MODEL_PARALLEL_GROUP": "expert", "_EXPERT_MODEL_PARALLEL_RANKS": "expert",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "tensor", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "expert_tensor",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "expert_tensor_pipeline",
    "_EXPERT_DATA_PARALLEL_GROUP": "expert_data", "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expert_data_gloo",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "expert_data",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expert_data_gloo",
    # megatron-core 0.19's groups "with GTP_remat" (weight rematerialisation, off here): with it off
    # megatron aliases each to its plain group, as here; 0.16 has none of them (not set there).
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "data", "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "data_context",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "data_context",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expert_data",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expert_data",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "expert_tensor_pipeline",
}


def _adopt(mesh: ParallelMesh) -> None:
    """Set megatron's parallel_state from the mesh's groups (megatron's initialize_model_parallel,
    with the groups made by build_mesh instead)."""
    missing = sorted(set(_GROUP_GLOBALS.values()) - set(mesh.library_groups))
    if missing:
        raise ValueError(f"the mesh passed to the megatron engine lacks megatron's groups {missing}: build it with "
                         f"common.engine.mesh.build_mesh(engine.parallel, dist, backend='megatron')")
    for name, key in _GROUP_GLOBALS.items():
        if not hasattr(parallel_state, name):  # a group this megatron-core does not have
            continue
        group = mesh.library_groups[key]
        if name.endswith("RANKS"):
            value = None if group is None else torch.distributed.get_process_group_ranks(group)
        else:
            value = group
        setattr(parallel_state, name, value)
    # One distributed-optimizer instance: its instance group is every rank of the engine.
    parallel_state._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = mesh.world_group
    parallel_state._set_global_memory_buffer()


def _unadopt() -> None:
    for name in (*_GROUP_GLOBALS, "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"):
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)
    parallel_state.destroy_global_memory_buffer()


def init_model_parallel(parallel: ParallelConfig, seed: int, timeout_s: float, dist,
                        mesh: ParallelMesh | None) -> tuple[ParallelMesh, bool]:
    """(the engine's mesh, whether the engine owns it). megatron's groups come from the mesh: the one
    passed in (build_mesh(..., backend="megatron")), else one built now over every process; its
    groups become parallel_state's. When parallel_state is set already (another of our engines, or
    the host with its own initialize_model_parallel) and no mesh is passed, the engine runs on those
    groups (same degrees, or a ValueError naming both). Then megatron's RNG tracker is seeded."""
    assert torch.distributed.is_initialized(), "init the default process group first (common.parallel.distributed)"
    from megatron.core.tensor_parallel import random as mp_random

    owned = False
    if parallel_state.model_parallel_is_initialized():
        if mesh is not None and mesh is not _USAGE.adopted:
            owner = "another megatron engine" if _USAGE.adopted is not None else "the host"
            raise ValueError(f"megatron's process groups in this process are {owner}'s already: build the engine "
                             f"without mesh= to run on them, or close {owner}'s groups first")
        _check_same_layout(parallel)
        mesh, owned = megatron_mesh(parallel), True
    else:
        if mesh is None:
            with groups_time_out_after(timeout_s):
                mesh, owned = build_mesh(parallel, dist, backend="megatron"), True
        _adopt(mesh)
        _USAGE.adopted = mesh
        if not compat.cpu_mode():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    if _USAGE.engines == 0:
        _USAGE.environ = {name: os.environ.get(name) for name in NVTE_VARIABLES}
        if compat.cpu_mode() and not compat.is_cpu_tracker(mp_random._CUDA_RNG_STATE_TRACKER):
            _USAGE.rng_tracker = (mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
            compat.seed_model_parallel_rng(seed)
    _USAGE.engines += 1
    compat.enable_cpu_shims()
    return mesh, owned


def release_model_parallel() -> None:
    """One engine is done with megatron's state; the last one puts back what the first found
    (parallel_state emptied when its groups were a mesh's we adopted; the shims, the RNG tracker,
    the environment)."""
    from megatron.core.tensor_parallel import random as mp_random

    assert _USAGE.engines > 0, "release_model_parallel without init_model_parallel"
    _USAGE.engines -= 1
    compat.disable_cpu_shims()
    if _USAGE.engines:
        return
    for name, value in _USAGE.environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if _USAGE.rng_tracker is not None:
        mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _USAGE.rng_tracker
        _USAGE.rng_tracker = None
    if _USAGE.adopted is not None:
        _unadopt()
        _USAGE.adopted = None


def megatron_mesh(parallel: ParallelConfig) -> ParallelMesh:
    """parallel_state's groups (set by the host, or from an earlier engine's mesh) as a
    common.engine.mesh.ParallelMesh of the engine's own. Its "dp" is data parallel without context
    parallelism: the context-parallel peers of a rank share its rows."""
    sizes = {TENSOR: parallel.tensor, PIPELINE: parallel.pipeline, CONTEXT: parallel.context,
             DATA: parallel_state.get_data_parallel_world_size(with_context_parallel=False)}
    groups = {DATA: parallel_state.get_data_parallel_group(with_context_parallel=False),
              CONTEXT: parallel_state.get_context_parallel_group(),
              TENSOR: parallel_state.get_tensor_model_parallel_group(),
              PIPELINE: parallel_state.get_pipeline_model_parallel_group()}
    # DDP's gradient all-reduce spans the context-parallel ranks too (megatron's dp x cp group).
    # Its world is the default group's: a megatron engine refuses a sub-world (engine.py).
    return ParallelMesh.from_groups(sizes=sizes, groups=groups,
                                    shard_group=parallel_state.get_data_parallel_group(with_context_parallel=True))


def mark_expert_parameters(model: torch.nn.Module) -> None:
    """Tag the routed experts' parameters as expert-parallel (allreduce=False) at every expert degree.
    megatron-core tags them only at EP > 1; then DDP reduces their gradients over the expert-data
    group and the optimizer steps them as a second, chained optimizer, whose checkpoint keys
    (chained_0. / chained_1.) differ from a single optimizer's: tagged always, a checkpoint resumes
    at another expert degree. At EP 1 the expert-data group is the data x context group, so the
    gradients and their scaling are the dense ones."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def release_trainable(model: torch.nn.Module, device: torch.device) -> None:
    """Each trainable parameter's data becomes a zero-stride tensor of its shape on `device`: one
    element of memory, `_base` None (what megatron-core's buffer asserts before re-pointing a
    parameter into it). megatron-core 0.16's _ParamAndGradBuffer allocates the whole parameter
    buffer while the parameters still own their storages and copies them over one by one, so a
    rank would hold its parameters twice at build; the weights are read in after wrap_ddp instead."""
    from ...common.parallel.host_memory import release_free_heap

    for param in model.parameters():
        if param.requires_grad:
            param.data = torch.empty_strided(param.shape, (0,) * param.dim(), dtype=param.dtype, device=device)
    # The freed storages under 1 MiB stay in glibc's heap (host_memory.py) unless handed back: the
    # buffers DDP allocates next would come on top of them (0.15 of the model at TP 2, some runs).
    release_free_heap()


def give_storage(model: torch.nn.Module) -> None:
    """Real storage for the parameters release_trainable left without (DDP without the distributed
    optimizer keeps each parameter's own data)."""
    for param in model.parameters():
        if param.numel() > 1 and all(stride == 0 for stride in param.stride()):
            param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)


def wrap_ddp(model: torch.nn.Module, tf_config, *, distributed_optimizer: bool) -> DistributedDataParallel:
    """Megatron DDP; the schedules call finalize_model_grads (DP all-reduce, or reduce-scatter for the
    distributed optimizer; SP norm all-reduce). With the distributed optimizer, every parameter
    becomes a view of one contiguous buffer per dtype (what the optimizer's shards and the
    all-gather after each step use)."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    tf_config.finalize_model_grads_func = finalize_model_grads
    with compat.cuda_to_cpu():
        return DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model: DistributedDataParallel, optim: OptimConfig, bf16: bool):
    """Megatron's Adam (AdamW form) over the model; grad clipping by the global norm (all TP/PP shards).
    optim.distributed_optimizer: megatron's DistributedOptimizer (the DDP wrapper must agree, wrap_ddp);
    bf16: fp32 main weights for the bf16 parameters.

    Megatron applies no weight decay to biases and norm weights (1-D parameters)."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip if optim.grad_clip is not None else _NO_CLIP,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=optim.distributed_optimizer,
    )
    with compat.cuda_to_cpu():
        return get_megatron_optimizer(config, [ddp_model])


class LRSchedule:
    """common.engine.schedule's warmup/cosine multiplier applied to a megatron optimizer's param groups."""

    def __init__(self, optimizer, optim: OptimConfig):
        from ...common.engine.schedule import lr_multiplier

        self._multiplier = lambda step: lr_multiplier(step, optim)
        self.optimizer = optimizer
        self.base_lr = optim.lr
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * self._multiplier(self.step_count)

    def get_last_lr(self) -> list[float]:
        return [self.base_lr * self._multiplier(self.step_count)]

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "base_lr": self.base_lr}

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.base_lr = state["step_count"], state["base_lr"]
        self._apply()


def optimizer_parts(optimizer) -> list:
    """A megatron optimizer's parts: a ChainedOptimizer's (dense and expert), else the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a megatron optimizer holds: Adam's state and the parameters it steps (for a
    mixed-precision optimizer its fp32 main copies; with fp32 they are the model's own, which
    common.engine.offload then counts as the model's). A ChainedOptimizer's parts in turn."""
    parts = getattr(optimizer, "chained_optimizers", None)
    if parts:
        return [tensor for part in parts for tensor in optimizer_tensors(part)]
    inner = getattr(optimizer, "optimizer", optimizer)  # megatron's wrapper around a torch optimizer
    state = [value for per_param in inner.state.values() for value in per_param.values() if torch.is_tensor(value)]
    return state + [p for group in inner.param_groups for p in group["params"]]
