"""FSDP2 critic engine: the shared critic (common.valuehead) sharded with fully_shard, trained with
the mini-batch-normalised clipped value loss on packed, token-budget micro-batches.

Built through common.engine.build_engine("fsdp", config, dist); the contract it implements is in
common/engine.py. Every rank is a data-parallel rank (the backend implements no model parallelism).
"""

from __future__ import annotations

import gc
import time
import warnings

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from .parallelize import parallelize_critic
from .sharded_load import load_sharded_critic
from ...common import fsdp2_shared, packed_attention
from ...common.batching import MicroBatch
from ...common.config import EngineConfig
from ...common.distributed import DistContext, barrier
from ...common.engine import RolloutBatch, check_batch_inputs, shift_to_tokens
from ...common.fsdp2_shared import forward_micro_batch, quiet_fsdp_views
from ...common.schedule import build_scheduler
from ...common.update_step import StepStats, plan_step, step_micro_batches
from ...common.valuehead import save_critic
from ...common.valuehead.attention import flash_attention_available

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def attention_for(config: EngineConfig) -> str | None:
    """Explicit choice wins; packed rows use varlen flash-attention, else our per-sequence attention."""
    if config.model.attn_implementation is not None:
        return config.model.attn_implementation
    if config.batching.packing:
        return "flash_attention_2" if flash_attention_available() else packed_attention.register()
    return None




class FSDPCriticEngine:
    def __init__(self, config: EngineConfig, dist: DistContext, *, dp_group=None):
        """`dp_group`: the ranks this engine shards over and averages with (default: all ranks)."""
        config.parallel.check_supported("fsdp", implemented=())
        self.config = config
        self.dist = dist
        self.dp_group = dp_group
        group = torch_dist.group.WORLD if dp_group is None else dp_group
        self.dp_rank, self.dp_size = torch_dist.get_rank(group), torch_dist.get_world_size(group)
        # The engine's own randomness (nothing in training draws from it today; saved in checkpoints).
        self.generator = torch.Generator().manual_seed(config.seed)
        cpu_offload = config.cpu_offload
        if cpu_offload and dist.device.type == "cpu":
            warnings.warn("engine.cpu_offload is ignored: this run is on CPU already (it offloads GPU shards)",
                          stacklevel=2)
            cpu_offload = False
        model_cfg = config.model
        self.model, self.load_report = load_sharded_critic(
            model_cfg.path,
            dtype=DTYPES[model_cfg.dtype],
            attn_implementation=attention_for(config),
            load_kwargs=dict(trust_remote_code=model_cfg.trust_remote_code, head_prefix=model_cfg.head_prefix,
                             fresh_head=model_cfg.fresh_head, head_init_seed=model_cfg.head_init_seed),
            parallelize=lambda model, mesh: parallelize_critic(
                model, mesh, mixed_precision=config.mixed_precision,
                gradient_checkpointing=config.gradient_checkpointing, cpu_offload=cpu_offload),
            device=dist.device,
            dp_group=group,
        )
        optim = config.optim
        # fused: one kernel for all parameters instead of a dozen elementwise ops per parameter.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           eps=optim.eps, weight_decay=optim.weight_decay, fused=True)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.vocab_size = self.model.config.get_text_config().vocab_size

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
        return out

    def accumulate_gradients(self, batch: RolloutBatch) -> StepStats:
        """Forward/backward over this rank's micro-batches (the first half of update). Gradients are
        those of the global mini-batch loss; returns the step's statistics (not yet reduced)."""
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
        return stats

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; returns the metrics of
        common.update_step.METRICS over the data-parallel group."""
        start = time.perf_counter()
        stats = self.accumulate_gradients(batch)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        grad_norm = self._clip_and_step()
        return stats.metrics(grad_norm=grad_norm, lr=lr, tokens=float(batch.attention_mask.sum()),
                             seconds=time.perf_counter() - start, dp_group=self.dp_group)

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.optim.grad_clip
        # clip_grad_norm_ over DTensor shards reduces across ranks: the norm of the full gradient.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        if isinstance(norm, DTensor):  # when the parameters are sharded
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save_checkpoint(self, directory: str, extra_state: dict | None = None) -> None:
        fsdp2_shared.save_checkpoint(directory, self, extra_state or {}, backend="fsdp")

    def checkpoint_bytes(self) -> int:
        return fsdp2_shared.checkpoint_bytes(self)

    def load_checkpoint(self, directory: str) -> dict:
        return fsdp2_shared.load_checkpoint(directory, self)

    def export_hf(self, directory: str) -> None:
        """Gather the full weights to rank 0 and write them with save_critic (fp32 master weights)."""
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dp_rank == 0:
            save_critic(self.model, directory, state_dict=full, overwrite=True)
        barrier(self.dp_group)

    def close(self) -> None:
        """Release the sharded model and optimizer. Call before destroying the process group: FSDP
        state still referencing gloo work at interpreter exit can abort the process."""
        del self.model, self.optimizer, self.scheduler
        gc.collect()
