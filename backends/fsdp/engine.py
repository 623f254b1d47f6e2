"""FSDP2 critic engine: the shared critic (common.valuehead) sharded with fully_shard, trained with
the mini-batch-normalised clipped value loss on packed, token-budget micro-batches.

Built through common.engine.build_engine("fsdp", config, dist); see common/engine.py for the API.
"""

from __future__ import annotations

import gc
import time
import warnings

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from backends.fsdp import checkpoint
from backends.fsdp.parallelize import parallelize_critic
from common import packed_attention
from common.batching import MicroBatch, count_micro_batches, make_micro_batches
from common.config import EngineConfig
from common.distributed import DistContext, all_reduce, barrier
from common.engine import RolloutBatch, shift_to_tokens
from common.loss import explained_variance_from_sums, loss_normalizer, value_loss
from common.schedule import build_scheduler
from common.valuehead import load_critic, save_critic
from common.valuehead.attention import flash_attention_available
from common.valuehead.values import compute_values

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def attention_for(config: EngineConfig) -> str | None:
    """Explicit choice wins; packed rows use varlen flash-attention, else our per-sequence sdpa."""
    if config.model.attn_implementation is not None:
        return config.model.attn_implementation
    if config.batching.packing:
        return "flash_attention_2" if flash_attention_available() else packed_attention.register()
    return None


class FSDPCriticEngine:
    def __init__(self, config: EngineConfig, dist: DistContext):
        self.config = config
        self.dist = dist
        # FSDP2 warns that a wrapped module returns a view (the head's output): harmless here, as
        # values are never modified in place.
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        torch.manual_seed(config.seed)
        model, self.load_report = load_critic(
            config.model.path,
            torch_dtype=DTYPES[config.model.dtype],
            attn_implementation=attention_for(config),
            trust_remote_code=config.model.trust_remote_code,
            head_prefix=config.model.head_prefix,
            fresh_head=config.model.fresh_head,
            head_init_seed=config.model.head_init_seed,
        )
        model.to(dist.device)
        cpu_offload = config.cpu_offload
        if cpu_offload and dist.device.type == "cpu":
            warnings.warn("engine.cpu_offload is ignored: this run is on CPU already (it offloads GPU shards)",
                          stacklevel=2)
            cpu_offload = False
        self.mesh = init_device_mesh(dist.device.type, (dist.world_size,))
        self.model = parallelize_critic(
            model, self.mesh,
            mixed_precision=config.mixed_precision,
            gradient_checkpointing=config.gradient_checkpointing,
            cpu_offload=cpu_offload,
        )
        optim = config.optim
        # fused: one kernel for all parameters instead of a dozen elementwise ops per parameter.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           eps=optim.eps, weight_decay=optim.weight_decay, fused=True)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.vocab_size = self.model.config.get_text_config().vocab_size

    # -- micro-batches -------------------------------------------------------------------------------
    def _micro_batches(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[MicroBatch]:
        """This rank's micro-batches; every rank runs the same number (FSDP's collectives must match)."""
        batching = self.config.batching
        local = count_micro_batches(attention_mask, token_budget=batching.micro_batch_tokens,
                                    micro_batch_size=batching.micro_batch_size)
        (count,) = all_reduce([local], op="max")
        return make_micro_batches(input_ids, attention_mask, packing=batching.packing,
                                  token_budget=batching.micro_batch_tokens,
                                  micro_batch_size=batching.micro_batch_size, min_micro_batches=int(count))

    def _forward(self, mb: MicroBatch, row_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values of the micro-batch's rows laid out [len(rows), row_length], the raw model output)."""
        device = self.dist.device
        values = compute_values(
            self.model,
            mb.input_ids.to(device),
            None if mb.attention_mask is None else mb.attention_mask.to(device),
            None if mb.position_ids is None else mb.position_ids.to(device),
        )
        return mb.unpack(values, row_length), values

    def _check_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Every rank raises together (one rank raising alone would leave the others in a collective)."""
        valid = input_ids[attention_mask.bool()]
        bad = bool(valid.numel()) and (int(valid.min()) < 0 or int(valid.max()) >= self.vocab_size)
        (any_bad,) = all_reduce([float(bad)], op="max")
        if any_bad:
            where = f"got [{int(valid.min())}, {int(valid.max())}] on this rank" if bad else "on another rank"
            raise ValueError(f"token ids must be in [0, {self.vocab_size}) for this model; {where}")

    # -- the engine API ------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """float32 [B, T] values at every position of this rank's rows (zero on padding), on CPU."""
        self._check_ids(input_ids, attention_mask)
        self.model.eval()
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for mb in self._micro_batches(input_ids, attention_mask):
            values, _ = self._forward(mb, input_ids.shape[1])
            if mb.rows:
                out[mb.rows] = values.cpu()
        return out

    def accumulate_gradients(self, batch: RolloutBatch) -> dict[str, float]:
        """Forward/backward over this rank's micro-batches (the first half of update); returns this
        rank's loss and token sums. Gradients are those of the global mini-batch loss."""
        self._check_ids(batch.input_ids, batch.attention_mask)
        loss_cfg = self.config.loss
        self.model.train()
        device = self.dist.device
        # Normalise over the whole mini-batch (all ranks, all micro-batches): results do not depend on the split.
        (normalizer,) = all_reduce([loss_normalizer(batch.response_mask, loss_cfg.agg_mode)])
        (horizon,) = all_reduce([batch.input_ids.shape[1]], op="max")

        totals = dict.fromkeys(("loss", "clipped", "valid", "r", "r2", "res", "res2"), 0.0)
        for mb in self._micro_batches(batch.input_ids, batch.attention_mask):
            values, raw = self._forward(mb, batch.input_ids.shape[1])
            if not mb.rows:
                (raw.sum() * 0.0).backward()  # keep this rank in step with the others' collectives
                continue
            pred = shift_to_tokens(values)
            mask = batch.response_mask[mb.rows].to(device)
            returns = batch.returns[mb.rows].to(device)
            loss, stats = value_loss(pred, batch.old_values[mb.rows].to(device), returns, mask,
                                     clip_range=loss_cfg.clip_range, agg_mode=loss_cfg.agg_mode,
                                     normalizer=normalizer, horizon=int(horizon))
            # FSDP averages gradients over ranks; the loss is already the global mean, so undo that.
            (loss * self.dist.world_size).backward()
            with torch.no_grad():
                valid = mask.bool()
                r, residual = returns[valid].double(), (returns - pred)[valid].double()
                totals["loss"] += float(loss)
                totals["clipped"] += stats["clip_fraction"] * stats["valid_tokens"]
                totals["valid"] += stats["valid_tokens"]
                totals["r"] += float(r.sum())
                totals["r2"] += float((r * r).sum())
                totals["res"] += float(residual.sum())
                totals["res2"] += float((residual * residual).sum())
        return totals

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; returns global metrics."""
        start = time.perf_counter()
        totals = self.accumulate_gradients(batch)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        grad_norm = self._clip_and_step()
        reduced = all_reduce(list(totals.values()) + [float(batch.attention_mask.sum())])
        g = dict(zip(totals, reduced))
        return {
            "value_loss": g["loss"],
            "clip_fraction": g["clipped"] / g["valid"] if g["valid"] else 0.0,
            "explained_variance": explained_variance_from_sums(g["valid"], g["r"], g["r2"], g["res"], g["res2"]),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": reduced[-1] / (time.perf_counter() - start),
            "valid_tokens": g["valid"],
        }

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.optim.grad_clip
        # clip_grad_norm_ over DTensor shards reduces across ranks: the norm of the full gradient.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save_checkpoint(self, directory: str, extra_state: dict | None = None) -> None:
        checkpoint.save_checkpoint(directory, self.model, self.optimizer, self.scheduler, extra_state or {}, self.dist)

    def checkpoint_bytes(self) -> int:
        """About how many bytes save_checkpoint writes (all ranks): model and optimizer state, plus 1 MiB."""
        tensors = list(self.model.parameters())
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        shards = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        local = sum(s.numel() * s.element_size() for s in shards)
        (total,) = all_reduce([float(local)])
        return int(total) + 2**20

    def load_checkpoint(self, directory: str) -> dict:
        return checkpoint.load_checkpoint(directory, self.model, self.optimizer, self.scheduler)

    def export_hf(self, directory: str) -> None:
        """Gather the full weights to rank 0 and write them with save_critic (fp32 master weights)."""
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dist.is_main:
            save_critic(self.model, directory, state_dict=full, overwrite=True)
        barrier()


    def close(self) -> None:
        """Release the sharded model and optimizer. Call before destroying the process group: FSDP
        state still referencing gloo work at interpreter exit can abort the process."""
        del self.model, self.optimizer, self.scheduler
        gc.collect()

