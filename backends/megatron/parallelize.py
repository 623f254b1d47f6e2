"""Megatron's process groups, the DDP wrapper and the optimizer, in the order the engine needs them.

  1. init_model_parallel: megatron's tensor / pipeline / data groups (module globals in
     megatron.core.parallel_state) inside the default process group, and the model-parallel RNG
     tracker (the CPU one from compat.py without CUDA).
  2. wrap_ddp: megatron's DistributedDataParallel (grad buffers, the data-parallel all-reduce that
     finalize_model_grads runs, plus the tensor-parallel all-reduce of sequence-parallel norms).
  3. build_optimizer: megatron's Adam with global grad-norm clipping across TP/PP ranks; its
     distributed optimizer on GPU (it cannot run on CPU, see compat.py).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from . import compat
from ...common.config import OptimConfig, ParallelConfig

# Clipping off still needs the norm for the metrics: clip at a bound no norm reaches.
_NO_CLIP = 1.0e30


def init_model_parallel(parallel: ParallelConfig, seed: int) -> None:
    """Create megatron's groups in the (already initialised) default process group; seed its RNGs."""
    assert torch.distributed.is_initialized(), "init the default process group first (common.distributed)"
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron's process groups already exist in this process: close() the other "
                           "megatron engine first (megatron keeps them as module globals)")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=parallel.tensor,
                                             pipeline_model_parallel_size=parallel.pipeline)
    if compat.cpu_mode():
        compat.enable_cpu_shims()
        compat.seed_model_parallel_rng(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    parallel_state.destroy_model_parallel()


def wrap_ddp(model: torch.nn.Module, tf_config) -> DistributedDataParallel:
    """Megatron DDP; the schedules call finalize_model_grads (DP all-reduce, SP norm all-reduce)."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=not compat.cpu_mode())
    tf_config.finalize_model_grads_func = finalize_model_grads
    with compat.cuda_to_cpu():
        return DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model: DistributedDataParallel, optim: OptimConfig, bf16: bool):
    """Megatron's Adam (AdamW form) over the model; grad clipping by the global norm (all TP/PP shards).

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
        use_distributed_optimizer=not compat.cpu_mode(),
    )
    with compat.cuda_to_cpu():
        return get_megatron_optimizer(config, [ddp_model])


class LRSchedule:
    """common.schedule's warmup/cosine multiplier applied to a megatron optimizer's param groups."""

    def __init__(self, optimizer, optim: OptimConfig):
        from ...common.schedule import lr_multiplier

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
