"""VeOmni critic engine: the critic built by VeOmni's build_foundation_model from the shared config
hook, rewritten by the configured transforms, sharded by VeOmni's FSDP2 parallelisation, trained
with VeOmni's optimizer and LR schedule and the shared mini-batch-normalised clipped value loss.

Built through common.engine.registry.build_engine("veomni", config, dist, mesh=None); the engine API and
everything but building is common.engine.fsdp2_core.FSDP2Engine's (the contract: common/engine/__init__.py). Every
rank of the mesh is a data-parallel rank, or, with engine.parallel.ulysses = N, a rank of a Ulysses group
(common/parallel/ulysses.py: our attention, not VeOmni's, which has no CPU backward) that VeOmni's FSDP2 shards
over with the data-parallel ranks.

VeOmni's parallel state is made from the engine's mesh (mesh_state.py: its groups are the mesh's, on
a host's sub-world too) and made VeOmni's ambient state only around each VeOmni call; VeOmni's
registry, topology cache and a host's own VeOmni state are left alone. The weights never go through
VeOmni's loader (which reads on global rank 0 and broadcasts over the default group): the shard
group's first rank loads the critic (common.engine.pipeline.load_on_first_rank) and every rank
fills the shards VeOmni built from it, tensor by tensor. Still global in VeOmni: its ops
configuration (a singleton set by build_foundation_model), the attention functions it registers
with transformers when `veomni` is imported, and its logger.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import FSDPModule

from . import parallelize, value_model
from .quiet import veomni_output
from ...common.engine.config import compute_dtype
from ...common.engine.fsdp2_core import DTYPES, FSDP2Engine, attention_for
from ...common.parallel import kernels
from ...common.engine.mesh import ParallelMesh, build_mesh
from ...common.engine.pipeline import build_sharded, engine_transforms
from ...common.engine.transforms import apply_transforms
from ...common.valuehead.config import install_value_head
from ...common.valuehead.load import plan_load


def reshard(model: torch.nn.Module) -> None:
    """Put every FSDP-wrapped module back on its sharded parameters. VeOmni shards the root without
    resharding after forward (its fused-linear kernels need that), so after a no-grad forward the
    root's registered parameters are unsharded copies, while the optimizer and checkpoints hold the
    shards: an optimizer built then would step tensors that the next forward throws away."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class VeOmniCriticEngine(FSDP2Engine):
    backend = "veomni"

    def _build_mesh(self) -> ParallelMesh:
        return build_mesh(self.config.parallel, self.dist)

    @contextlib.contextmanager
    def _veomni(self):
        """This engine's parallel state as VeOmni's ambient one, and VeOmni's output kept off our
        stdout (quiet.veomni_output), around a VeOmni call."""
        from veomni.distributed.parallel_state import use_parallel_state

        with veomni_output(), use_parallel_state(self.parallel_state):
            yield

    @contextlib.contextmanager
    def _veomni_build(self):
        """_veomni, leaving the process's RNG as it was: VeOmni initialises what it builds at random
        (the engine overwrites it with the loaded critic)."""
        device = self.dist.device
        with self._veomni(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield

    def _build(self):
        model_cfg = self.config.model
        # Config and tensor headers only: refuse what VeOmni cannot build before anything is loaded.
        self.hf_config = plan_load(model_cfg.path, head_prefix=model_cfg.head_prefix,
                                   trust_remote_code=model_cfg.trust_remote_code,
                                   value_head=self.config.loss.support).config
        value_model.check_layout(self.hf_config, self.config, self.dist.world_size)  # the launcher's check, the same function
        with veomni_output():
            from .mesh_state import parallel_state_for

            self.parallel_state = parallel_state_for(self.parallel, self.dist.device.type)
        model, report = self._build_model()
        with self._veomni():
            optimizer = parallelize.build_optimizer(model, self.config.optim)  # trainable parameters only
            scheduler = parallelize.build_lr_scheduler(optimizer, self.config.optim)
        return model, report, optimizer, scheduler

    def _build_model(self):
        """The pipeline: the shard group's first rank loads and transforms the critic; VeOmni builds
        the same tree (on meta with 2+ data-parallel ranks, in place with one), the transforms rewrite it,
        VeOmni parallelises and materialises it, and every rank fills its part from the first rank's
        state (a name either side lacks is an error); then the dispatch checks, the probe on the
        critic's one-layer twin (value_model.probe_config)."""
        # FSDP2 whenever there are several data-parallel ranks: with replicas of one shard each, it is
        # FSDP2 that all-reduces the gradients across the replicas (VeOmni's FSDP-off path has no reduction).
        model_cfg, fsdp = self.config.model, self.shard_size > 1 or self.parallel.replicate_size > 1
        transforms = engine_transforms(self.config)
        load_kwargs = dict(trust_remote_code=model_cfg.trust_remote_code, head_prefix=model_cfg.head_prefix,
                           fresh_head=model_cfg.fresh_head, head_init_seed=model_cfg.head_init_seed,
                           value_head=self.config.loss.support, init_from_scalar_head=model_cfg.init_from_scalar_head)
        device = self.dist.device
        # VeOmni applies bf16 mixed precision only through FSDP2 (with 2+ shard ranks; parallelize.py).
        compute = compute_dtype(self.config, mixed_precision_applies=fsdp)
        attention = attention_for(self.config, self.hf_config, compute)
        attn = attention.kernel
        ops = kernels.veomni_ops(have=kernels.installed())

        def build_tree(report, config=self.hf_config, *, init_device="meta" if fsdp else device.type,
                       dtype=model_cfg.dtype):
            # VeOmni's own build: on meta when sharded, at random (overwritten) with one rank
            with self._veomni_build():
                model = value_model.build_critic(config, weights_path=None, dtype=dtype, attn_implementation=attn,
                                                 init_device=init_device, fused_ops=ops.kernel,
                                                 parallel_state=self.parallel_state)
            value_model.check_class(model, config)
            return install_value_head(model)

        def parallelize_tree(model):  # VeOmni materialises the shards (filled after)
            with self._veomni_build():
                return parallelize.parallelize(model, self.config, fsdp=fsdp)

        model, report = build_sharded(
            model_cfg.path, shard_group=self.shard_group, shard_rank=self.parallel.shard_rank, device=device,
            dtype=DTYPES[model_cfg.dtype], attn_implementation=attn, load_kwargs=load_kwargs, transforms=transforms,
            build_tree=build_tree, parallelize=parallelize_tree)
        value_model.check_materialized(model)
        # The probe's forward runs on a twin built as the critic was, whole on this device in the
        # critic's compute dtype (random weights: the outcome does not depend on them), not on the
        # sharded critic, whose forward would gather whole layers.
        twin_cfg = value_model.probe_config(self.hf_config)
        twin = apply_transforms(build_tree(report, twin_cfg, init_device=device.type,
                                           dtype=str(compute).removeprefix("torch.")), transforms)
        assert isinstance(model, type(twin)), (type(model), type(twin))
        value_model.check_probe_output(twin, twin_cfg, device, sp_group=self.sp_group)
        del twin
        reshard(model)
        report.attn_implementation = model.config._attn_implementation
        report.kernels = f"attention {attention}; VeOmni ops {ops}"
        return model.eval(), report

    # -- hooks of the FSDP2 core ---------------------------------------------------------------------
    def _grad_norm(self, max_norm: float) -> torch.Tensor:
        with self._veomni():
            if hasattr(self.model, "clip_grad_norm_"):  # attached by VeOmni's FSDP2 parallelisation
                return self.model.clip_grad_norm_(max_norm)
            return super()._grad_norm(max_norm)  # one rank: no FSDP

    def _settle(self) -> None:
        reshard(self.model)

    def _export_config(self):
        return value_model.without_veomni_fields(self.model.config)

    def _release(self) -> None:
        self.parallel_state = None
