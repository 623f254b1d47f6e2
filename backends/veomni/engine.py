"""VeOmni critic engine: the critic built by VeOmni's build_foundation_model from the shared config
hook, sharded by VeOmni's FSDP2 parallelisation, trained with VeOmni's optimizer and LR schedule and
the shared mini-batch-normalised clipped value loss (common.update_step) on packed micro-batches.

Built through common.engine.build_engine("veomni", config, dist); the contract it implements is in
common/engine.py. Every rank is a data-parallel rank (Ulysses is refused on CPU: compat.py).

VeOmni keeps global state: its parallel state (a process global plus a topology cache), its ops
configuration (a singleton set by build_foundation_model), the attention functions it registers
with transformers when `veomni` is imported, and its logger. One VeOmni engine per process at a
time; close() forgets the parallel state.
"""

from __future__ import annotations

import gc
import pickle
import tempfile
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from . import compat, parallelize, value_model
from ...common import fsdp2_shared, packed_attention
from ...common.batching import MicroBatch
from ...common.config import EngineConfig
from ...common.distributed import DistContext, barrier, broadcast_object
from ...common.engine import RolloutBatch, check_batch_inputs, shift_to_tokens
from ...common.fsdp2_shared import forward_micro_batch, quiet_fsdp_views
from ...common.update_step import StepStats, plan_step, step_micro_batches
from ...common.valuehead import save_critic
from ...common.valuehead.attention import flash_attention_available
from ...common.valuehead.load import plan_load


def check_parallel(config: EngineConfig) -> None:
    """Degrees this backend does not implement, by key, before any group or model exists."""
    config.parallel.check_supported("veomni", implemented=("ulysses",))
    compat.check_ulysses(config.parallel.ulysses)
    if config.parallel.ulysses > 1:
        raise ValueError(f"engine.parallel.ulysses={config.parallel.ulysses}: the veomni engine does not implement "
                         f"Ulysses sequence parallelism yet (the critic's value gather and loss over sequence "
                         f"shards are not written); set engine.parallel.ulysses=1")


def attention_for(config: EngineConfig) -> str:
    """Explicit choice wins; packed rows use varlen flash-attention, else our per-sequence attention;
    padded rows sdpa."""
    if config.model.attn_implementation is not None:
        return config.model.attn_implementation
    if config.batching.packing:
        return "flash_attention_2" if flash_attention_available() else packed_attention.register()
    return "sdpa"


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




class VeOmniCriticEngine:
    def __init__(self, config: EngineConfig, dist: DistContext):
        check_parallel(config)
        self.config = config
        self.dist = dist
        self.dp_group = None  # every rank is a data-parallel rank
        self.dp_rank, self.dp_size = dist.rank, dist.world_size
        # The engine's own randomness (nothing in training draws from it today; saved in checkpoints).
        self.generator = torch.Generator().manual_seed(config.seed)
        model_cfg = config.model
        # Config and tensor headers only: refuse what VeOmni cannot build before anything is loaded.
        self.hf_config = plan_load(model_cfg.path, head_prefix=model_cfg.head_prefix,
                                   trust_remote_code=model_cfg.trust_remote_code).config
        value_model.check_family_registered(self.hf_config)
        self.parallel_state = parallelize.init_parallel_state(dist.world_size, config.parallel.ulysses)
        try:
            self.model, self.load_report = self._build()
        except BaseException:
            parallelize.release_parallel_state()
            raise
        with self._veomni(), value_model.quiet_veomni():
            self.optimizer = parallelize.build_optimizer(self.model, config.optim)
            self.scheduler = parallelize.build_lr_scheduler(self.optimizer, config.optim)
        self.vocab_size = self.hf_config.get_text_config().vocab_size

    def _veomni(self):
        """This engine's parallel state as VeOmni's ambient one, around a VeOmni call."""
        from veomni.distributed.parallel_state import use_parallel_state

        return use_parallel_state(self.parallel_state)

    def _build(self):
        """Rank 0 writes the checkpoint in the TokenCls layout; VeOmni builds the critic from it (on
        meta and sharded, rank 0 reading and broadcasting, with 2+ ranks), then the dispatch checks."""
        model_cfg, fsdp = self.config.model, self.dp_size > 1
        load_kwargs = dict(trust_remote_code=model_cfg.trust_remote_code, head_prefix=model_cfg.head_prefix,
                           fresh_head=model_cfg.fresh_head, head_init_seed=model_cfg.head_init_seed)
        weights_dir = report = error = None
        if self.dist.is_main:
            weights_dir = tempfile.mkdtemp(prefix="critic_adapters_veomni_")
            try:
                report = value_model.write_token_classification_weights(model_cfg.path, weights_dir,
                                                                         load_kwargs=load_kwargs)
            except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                error = err if _picklable(err) else RuntimeError(f"{type(err).__name__}: {err}")
        report, error, weights_dir = broadcast_object((report, error, weights_dir))
        try:
            if error is not None:
                raise error
            device = self.dist.device
            init_device = "meta" if fsdp else device.type
            with self._veomni(), value_model.quiet_veomni():
                model = value_model.build_critic(self.hf_config, weights_path=weights_dir, dtype=model_cfg.dtype,
                                                 attn_implementation=attention_for(self.config),
                                                 init_device=init_device)
                value_model.check_class(model, self.hf_config)
                model = parallelize.parallelize(model, self.config, fsdp=fsdp, weights_path=weights_dir)
            value_model.check_materialized(model)
            with quiet_fsdp_views():
                value_model.check_probe_output(model, self.hf_config, device)
            reshard(model)
        finally:
            barrier()  # every rank has read what it needs before rank 0 removes the directory
            if self.dist.is_main:
                value_model.remove_dir(weights_dir)
        report.attn_implementation = model.config._attn_implementation
        return model.eval(), report

    # -- micro-batches -------------------------------------------------------------------------------
    def _micro_batches(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[MicroBatch]:
        """This rank's micro-batches; every DP rank runs the same number (FSDP's collectives must match)."""
        return step_micro_batches(input_ids, attention_mask, self.config.batching, group=self.dp_group)

    def _forward(self, mb: MicroBatch, row_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return forward_micro_batch(self.model, mb, row_length, self.dist.device)

    # -- the engine API ------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """float32 [B, T] values at every position of this rank's rows (zero on padding), on CPU."""
        check_batch_inputs(input_ids, attention_mask, vocab_size=self.vocab_size, group=self.dp_group)
        self.model.eval()
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for mb in self._micro_batches(input_ids, attention_mask):
            values, _ = self._forward(mb, input_ids.shape[1])
            if mb.rows:
                out[mb.rows] = values.cpu()
        self._reshard()
        return out

    def _reshard(self) -> None:
        reshard(self.model)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; returns the metrics of
        common.update_step.METRICS over the data-parallel group."""
        start = time.perf_counter()
        check_batch_inputs(batch.input_ids, batch.attention_mask, vocab_size=self.vocab_size, batch=batch,
                           group=self.dp_group)
        self.model.train()
        device = self.dist.device
        stats = StepStats(self.config.loss, plan_step(batch, self.config.loss, self.dp_group), device)
        for mb in self._micro_batches(batch.input_ids, batch.attention_mask):
            values, raw = self._forward(mb, batch.input_ids.shape[1])
            if not mb.rows:
                (raw.sum() * 0.0).backward()  # keep this rank in step with the others' collectives
                continue
            loss = stats.micro_batch_loss(shift_to_tokens(values), batch.old_values[mb.rows].to(device),
                                          batch.returns[mb.rows].to(device), batch.response_mask[mb.rows].to(device))
            # FSDP averages gradients over DP ranks; the loss is already the global mean, so undo that.
            with quiet_fsdp_views():
                (loss * self.dp_size).backward()
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        grad_norm = self._clip_and_step()
        return stats.metrics(grad_norm=grad_norm, lr=lr, tokens=float(batch.attention_mask.sum()),
                             seconds=time.perf_counter() - start, dp_group=self.dp_group)

    def _clip_and_step(self) -> float:
        max_norm = self.config.optim.grad_clip
        max_norm = max_norm if max_norm is not None else float("inf")
        with self._veomni():
            if hasattr(self.model, "clip_grad_norm_"):  # attached by VeOmni's FSDP2 parallelisation
                norm = self.model.clip_grad_norm_(max_norm)
            else:  # one rank: no FSDP
                norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None],
                                                      max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save_checkpoint(self, directory: str, extra_state: dict | None = None) -> None:
        self._reshard()
        fsdp2_shared.save_checkpoint(directory, self, extra_state or {}, backend="veomni")

    def checkpoint_bytes(self) -> int:
        return fsdp2_shared.checkpoint_bytes(self)

    def load_checkpoint(self, directory: str) -> dict:
        self._reshard()
        return fsdp2_shared.load_checkpoint(directory, self)

    def export_hf(self, directory: str) -> None:
        """Gather the full weights to rank 0 and write them with save_critic (fp32 master weights)."""
        self._reshard()
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dp_rank == 0:
            with value_model.without_veomni_fields(self.model.config):
                save_critic(self.model, directory, state_dict=full, overwrite=True)
        barrier(self.dp_group)

    def close(self) -> None:
        """Release the model and optimizer and forget VeOmni's parallel state. Call before destroying the
        process group: FSDP state still referencing gloo work at interpreter exit can abort the process."""
        del self.model, self.optimizer, self.scheduler
        gc.collect()
        parallelize.release_parallel_state()

