"""VeOmni critic engine: the critic built by VeOmni's build_foundation_model from the shared config
hook, rewritten by the configured transforms, sharded by VeOmni's FSDP2 parallelisation, trained
with VeOmni's optimizer and LR schedule and the shared mini-batch-normalised clipped value loss.

Built through common.engine.registry.build_engine("veomni", config, dist); the engine API and everything
but building is common.engine.fsdp2_core.FSDP2Engine's (the contract: common/engine/__init__.py). Every rank is a
data-parallel rank, or, with engine.parallel.ulysses = N, a rank of a Ulysses group (common/parallel/ulysses.py:
our attention, not VeOmni's, which has no CPU backward) that VeOmni's FSDP2 shards over with the
data-parallel ranks.

VeOmni keeps global state: its parallel state (a process global plus a topology cache), its ops
configuration (a singleton set by build_foundation_model), the attention functions it registers
with transformers when `veomni` is imported, and its logger. Engines of one topology share VeOmni's
cached parallel state (another of ours or the host's); the last of our engines to close clears it,
unless the host had one before.
"""

from __future__ import annotations

import contextlib
import pickle
import tempfile

import torch
from torch.distributed.fsdp import FSDPModule

from . import parallelize, value_model
from .quiet import veomni_output
from ...common.parallel.distributed import barrier, broadcast_object
from ...common.engine.fsdp2_core import FSDP2Engine, attention_for, quiet_fsdp_views
from ...common.engine.mesh import DATA, ULYSSES, ParallelMesh, check_spans_world, mesh_sizes
from ...common.engine.pipeline import engine_transforms
from ...common.engine.transforms import apply_transforms, resolve_transforms
from ...common.valuehead.config import install_value_head
from ...common.valuehead.load import plan_load


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any pickling failure means "send a description instead"
        return False
    return True


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

    def __init__(self, config, dist, *, mesh: ParallelMesh | None = None):
        """`mesh`: accepted when it spans every process with the config's degrees; VeOmni's builders
        read its own parallel state (a process-wide device mesh it builds with init_device_mesh over
        the default group), so the engine builds that state for the same layout and runs on it. A
        sub-world is refused: VeOmni's ParallelState reads world size and rank from the default
        group, and its loader broadcasts from global rank 0 (dist.broadcast(src=0)), which is not a
        critic rank there."""
        if mesh is not None:
            mesh.check_matches(config.parallel, who="the veomni engine")
            check_spans_world(mesh, who="the veomni engine",
                              why="VeOmni 0.1.12's parallel state takes its world size and ranks from the default "
                                  "group, and its weight loader reads on global rank 0 and broadcasts from it over "
                                  "the default group (veomni.models.module_utils)")
        super().__init__(config, dist)

    def _build_mesh(self) -> ParallelMesh:
        """VeOmni's parallel state (its device mesh) as this engine's mesh."""
        model_cfg = self.config.model
        # Config and tensor headers only: refuse what VeOmni cannot build before anything is loaded.
        self.hf_config = plan_load(model_cfg.path, head_prefix=model_cfg.head_prefix,
                                   trust_remote_code=model_cfg.trust_remote_code,
                                   value_head=self.config.loss.support).config
        with veomni_output():
            value_model.check_family_registered(self.hf_config)
            sizes = mesh_sizes(self.config.parallel, self.dist.world_size)
            self.parallel_state = parallelize.init_parallel_state(self.dist.world_size, self.config.parallel.ulysses)
        state = self.parallel_state
        if self.config.parallel.ulysses == 1:
            return ParallelMesh.from_groups(sizes=sizes, groups={DATA: state.dp_group}, device_mesh=state.device_mesh)
        # Ulysses: VeOmni's FSDP shards over its dp_shard_sp dimension (data parallel x Ulysses).
        return ParallelMesh.from_groups(sizes=sizes, groups={DATA: state.dp_group, ULYSSES: state.ulysses_group},
                                        device_mesh=state.device_mesh, shard_group=state.fsdp_mesh.get_group(),
                                        shard_device_mesh=state.fsdp_mesh)

    @contextlib.contextmanager
    def _veomni(self):
        """This engine's parallel state as VeOmni's ambient one, and VeOmni's output kept off our
        stdout (quiet.veomni_output), around a VeOmni call."""
        from veomni.distributed.parallel_state import use_parallel_state

        with veomni_output(), use_parallel_state(self.parallel_state):
            yield

    def _build(self):
        model, report = self._build_model()
        with self._veomni():
            optimizer = parallelize.build_optimizer(model, self.config.optim)  # trainable parameters only
            scheduler = parallelize.build_lr_scheduler(optimizer, self.config.optim)
        return model, report, optimizer, scheduler

    def _build_model(self):
        """Rank 0 writes the checkpoint in the TokenCls layout; VeOmni builds the critic from it (on
        meta and sharded, rank 0 reading and broadcasting, with 2+ ranks), then the dispatch checks."""
        model_cfg, fsdp = self.config.model, self.shard_size > 1
        transforms = engine_transforms(self.config)
        load_kwargs = dict(trust_remote_code=model_cfg.trust_remote_code, head_prefix=model_cfg.head_prefix,
                           fresh_head=model_cfg.fresh_head, head_init_seed=model_cfg.head_init_seed,
                           value_head=self.config.loss.support, init_from_scalar_head=model_cfg.init_from_scalar_head)
        # Sharded (2+ ranks), VeOmni fills every rank's meta tree by name from what rank 0 writes: a
        # transform that adds or renames parameters (LoRA) must be applied before writing. With one
        # rank the critic is built from the plain weights and transformed in place.
        rewrites_keys = fsdp and any(t.to_plain is not None for t in resolve_transforms(transforms))
        weights_dir = report = error = None
        if self.dist.is_main:
            weights_dir = tempfile.mkdtemp(prefix="critic_adapters_veomni_")
            try:
                report = value_model.write_token_classification_weights(
                    model_cfg.path, weights_dir, load_kwargs=load_kwargs,
                    transform=(lambda critic: apply_transforms(critic, transforms)) if rewrites_keys else None)
            except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                error = err if _picklable(err) else RuntimeError(f"{type(err).__name__}: {err}")
        report, error, weights_dir = broadcast_object((report, error, weights_dir), group=self.parallel.world_group)
        try:
            if error is not None:
                raise error
            device = self.dist.device
            init_device = "meta" if fsdp else device.type
            with self._veomni():
                model = value_model.build_critic(self.hf_config, weights_path=weights_dir, dtype=model_cfg.dtype,
                                                 attn_implementation=attention_for(self.config, padded="sdpa"),
                                                 init_device=init_device)
                value_model.check_class(model, self.hf_config)
                model = apply_transforms(install_value_head(model), transforms)
                if rewrites_keys:
                    mismatch = value_model.check_weights_cover(model, weights_dir) if self.dist.is_main else None
                    mismatch = broadcast_object(mismatch, group=self.parallel.world_group)
                    if mismatch:
                        raise ValueError(mismatch)
                model = parallelize.parallelize(model, self.config, fsdp=fsdp, weights_path=weights_dir)
            value_model.check_materialized(model)
            with quiet_fsdp_views():
                value_model.check_probe_output(model, self.hf_config, device, sp_group=self.sp_group)
            reshard(model)
        finally:
            barrier(self.parallel.world_group)  # every rank has read what it needs before rank 0 removes the directory
            if self.dist.is_main:
                value_model.remove_dir(weights_dir)
        report.attn_implementation = model.config._attn_implementation
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
        parallelize.release_parallel_state()
