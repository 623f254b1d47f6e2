"""FSDP2 critic engine: the shared critic (common.valuehead), rewritten by the configured transforms,
sharded with fully_shard over the mesh's data-parallel ranks and trained with the
mini-batch-normalised clipped value loss on packed, token-budget micro-batches.

Built through common.engine.registry.build_engine("fsdp", config, dist, mesh=None); the engine API and
everything but building is common.engine.fsdp2_core.FSDP2Engine's (the contract: common/engine/__init__.py). Its
one model-parallel dimension is Ulysses (engine.parallel.ulysses = N, common/parallel/ulysses.py): each
sequence split over N ranks, and FSDP shards over data parallel x Ulysses; without it every rank of
the mesh is a data-parallel rank.
"""

from __future__ import annotations

import dataclasses

from .parallelize import parallelize_critic
from .sharded_load import load_sharded_critic
from ...common.engine.config import compute_dtype
from ...common.engine.fsdp2_core import DTYPES, FSDP2Engine, attention_for
from ...common.engine.registry import read_model
from ...common.engine.mesh import ParallelMesh, build_mesh
from ...common.engine.schedule import build_scheduler
from ...common.engine.pipeline import engine_transforms
from ...common.engine.optimizers import build_optimizer


class FSDPCriticEngine(FSDP2Engine):
    backend = "fsdp"

    def _build_mesh(self) -> ParallelMesh:
        return build_mesh(self.config.parallel, self.dist)

    def _build(self):
        config, dist = self.config, self.dist
        # engine.cpu_offload: FSDP2's CPUOffloadPolicy on every device (on a CPU mesh the shards stay
        # where they are, and the same code runs as on GPU).
        cpu_offload = config.cpu_offload
        model_cfg = config.model
        # fully_shard applies a mixed-precision policy at any shard count (parallelize_critic).
        attention = attention_for(config, read_model(config).critic_config, compute_dtype(config))
        model, report = load_sharded_critic(
            model_cfg.path,
            dtype=DTYPES[model_cfg.dtype],
            attn_implementation=attention.kernel,
            load_kwargs=dict(trust_remote_code=model_cfg.trust_remote_code, head_prefix=model_cfg.head_prefix,
                             fresh_head=model_cfg.fresh_head, head_init_seed=model_cfg.head_init_seed,
                             value_head=config.loss.support, init_from_scalar_head=model_cfg.init_from_scalar_head),
            transforms=engine_transforms(config),
            parallelize=lambda critic, mesh: parallelize_critic(
                critic, mesh, mixed_precision=config.mixed_precision,
                gradient_checkpointing=config.gradient_checkpointing, cpu_offload=cpu_offload),
            device=dist.device,
            mesh=self.parallel,
            cpu_offload=cpu_offload,
        )
        report = dataclasses.replace(report, kernels=f"attention {attention}")
        optimizer = build_optimizer(model, config.optim)  # engine.optim.name / state_dtype
        return model, report, optimizer, build_scheduler(optimizer, config.optim)
