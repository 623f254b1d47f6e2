"""The per-micro-batch value loss and the step's metrics, shared by every backend's update.

A backend owns its micro-batch loop (FSDP: a Python loop; Megatron: forward_backward_func with a
loss closure) and calls `StepStats.micro_batch_loss` on each micro-batch's predictions. Statistics
stay tensors on the device; they are brought to the host and reduced over the data-parallel group
once per step, in `StepStats.metrics`. The metric names are part of the engine contract
(docs/ARCHITECTURE.md):

  value_loss          the mini-batch's clipped value loss (normalised over all its DP ranks); with
                      loss.kind=hl_gauss its cross-entropy against the HL-Gauss targets. The value
                      loss alone: the step's objective is value_loss + coef * router_aux_loss
  router_aux_loss     only with loss.router_aux_coef > 0: the router load-balancing loss without the
                      coefficient, the mean over the step's forward passes (common.engine.router_aux)
  clip_fraction       share of valid tokens where the clipped term was the larger one (0 for hl_gauss)
  explained_variance  1 - Var[R - V] / Var[R] over the mini-batch's valid tokens, before the step
  grad_norm           global gradient norm before clipping
  lr                  the learning rate this step used
  tokens_per_s        non-padding tokens of the mini-batch (all DP ranks) per second of the step
  valid_tokens        tokens the loss covered (the value mask's; without one the response tokens)
  value/mean, value/std, return/mean, return/std
                      the critic's values (before the step) and the returns over those tokens
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import torch

from ..parallel.batching import MicroBatch, count_micro_batches, make_micro_batches
from .config import BatchingConfig, LossConfig
from ..parallel.distributed import all_reduce
from . import RolloutBatch
from ..learning.hl_gauss import expectation
from ..learning.loss import explained_variance_from_sums, hl_gauss_loss_terms, loss_normalizer, value_loss_terms

# docs/METRICS.md defines each one.
METRICS = ("value_loss", "mse", "clip_fraction", "explained_variance", "grad_norm", "lr", "tokens_per_s",
           "valid_tokens", "value/mean", "value/std", "return/mean", "return/std")
# With engine.loss.router_aux_coef > 0 also router_aux_loss (the coefficient-free router load-balancing
# loss, common.engine.router_aux.StepAux; value_loss leaves it out).
_VALUE_SUMS = ("loss", "clipped", "valid", "r", "r2", "res", "res2", "v", "v2")  # micro_batch_loss's
_SUMS = (*_VALUE_SUMS, "router_aux")


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """Constants of one mini-batch, agreed by its data-parallel ranks before the first micro-batch."""

    normalizer: float
    """What the aggregation mode divides by, over the whole mini-batch (all DP ranks)."""
    horizon: int
    """Longest row of the mini-batch (seq-mean-token-sum-norm divides by it)."""


def plan_step(batch: RolloutBatch, loss: LossConfig, dp_group) -> StepPlan:
    (normalizer,) = all_reduce([loss_normalizer(batch.loss_mask, loss.agg_mode)], group=dp_group)
    (horizon,) = all_reduce([batch.input_ids.shape[1]], op="max", group=dp_group)
    return StepPlan(normalizer=normalizer, horizon=int(horizon))


def step_micro_batches(input_ids: torch.Tensor, attention_mask: torch.Tensor, batching: BatchingConfig, *,
                       group, forward_only: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches, as many as the busiest rank of `group` needs: ranks that share
    collectives (FSDP's gathers, Megatron's schedules) must run the same number. forward_only
    (compute_values): batching.forward_micro_batch_tokens is the budget when it is set."""
    key, budget = "micro_batch_tokens", batching.micro_batch_tokens
    if forward_only and batching.forward_micro_batch_tokens is not None:
        key, budget = "forward_micro_batch_tokens", batching.forward_micro_batch_tokens
    if batching.micro_batch_size is None:
        warn_over_budget(attention_mask, f"engine.batching.{key}", budget)
    local = count_micro_batches(attention_mask, token_budget=budget, micro_batch_size=batching.micro_batch_size)
    (count,) = all_reduce([local], op="max", group=group)
    return make_micro_batches(input_ids, attention_mask, packing=batching.packing, token_budget=budget,
                              micro_batch_size=batching.micro_batch_size, min_micro_batches=int(count))


_WARNED_LONGEST: dict[tuple[str, int], int] = {}
"""(key, budget): the longest row a warning of warn_over_budget named, so each is said once per process."""


def warn_over_budget(attention_mask: torch.Tensor, key: str, budget: int) -> None:
    """warnings.warn when a row of this rank is longer than the token budget `key` sets: such a row
    runs as a micro-batch of its own, over the budget, and rows that long all alone make many small,
    slow micro-batches. Once per key and budget, again only for a longer row than the last warning's."""
    longest = int(attention_mask.sum(dim=-1).max()) if attention_mask.numel() else 0
    if longest <= max(budget, _WARNED_LONGEST.get((key, budget), 0)):
        return
    _WARNED_LONGEST[key, budget] = longest
    fits = 1 << (longest - 1).bit_length()  # the next power of two
    warnings.warn(f"{key}={budget} is below the longest row's {longest} tokens: each row over the budget runs as "
                  f"a micro-batch of its own (many small micro-batches are slow); set {key}={fits} (>= {longest}) "
                  f"to fit it", stacklevel=3)


def whole_micro_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, batching: BatchingConfig, *,
                      group) -> MicroBatch:
    """All of this rank's rows as one micro-batch (packed or padded as `batching` says), for a host
    that sizes its own micro-batches (forward_backward); collective over `group`."""
    (budget,) = all_reduce([max(int(attention_mask.sum()), 1)], op="max", group=group)
    whole = dataclasses.replace(batching, micro_batch_tokens=int(budget), micro_batch_size=None)
    (micro_batch,) = step_micro_batches(input_ids, attention_mask, whole, group=group)
    return micro_batch


class StepStats:
    """Loss and statistics of one update step, accumulated over its micro-batches as tensors."""

    def __init__(self, loss: LossConfig, plan: StepPlan, device: torch.device):
        self.loss_config = loss
        self.support = loss.support
        self.plan = plan
        self.sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)

    def micro_batch_loss(self, predictions: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                         response_mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mini-batch loss; its micro-batches' losses add up to the
        mini-batch loss, however the mini-batch was split. `response_mask`: the tokens the loss
        counts (RolloutBatch.loss_mask: the value mask when the batch has one). `predictions` are for tokens (shifted):
        [b, T] values, or with loss.kind=hl_gauss [b, T, num_bins] bin logits."""
        support = self.support
        if support is None:
            loss, clipped, valid = value_loss_terms(
                predictions, old_values, returns, response_mask, clip_range=self.loss_config.clip_range,
                agg_mode=self.loss_config.agg_mode, normalizer=self.plan.normalizer, horizon=self.plan.horizon)
        else:
            loss, valid = hl_gauss_loss_terms(predictions, returns, response_mask, support,
                                              agg_mode=self.loss_config.agg_mode, normalizer=self.plan.normalizer,
                                              horizon=self.plan.horizon)
            clipped = valid * 0
            predictions = expectation(predictions.detach(), support)
        with torch.no_grad():
            mask = response_mask.bool()
            r = torch.where(mask, returns, 0).double()
            residual = torch.where(mask, returns - predictions, 0).double()
            v = torch.where(mask, predictions.detach(), 0).double()
            terms = [loss.detach().double(), clipped.double(), valid.double(), r.sum(), (r * r).sum(),
                     residual.sum(), (residual * residual).sum(), v.sum(), (v * v).sum()]  # _VALUE_SUMS
            self.sums[:len(_VALUE_SUMS)] += torch.stack(terms)
        return loss

    def add_router_aux(self, share: torch.Tensor) -> None:
        """Count a micro-batch's share of the step's router load-balancing loss, without the
        coefficient (common.engine.router_aux.StepAux.term): the metric router_aux_loss."""
        self.sums[len(_VALUE_SUMS)] += share.detach().double()

    def metrics(self, *, grad_norm: float, lr: float, tokens: float, seconds: float, dp_group,
                counts: bool = True) -> dict:
        """The step's metrics over `dp_group` (one host sync, one collective).

        A backend whose ranks hold copies of a data-parallel share (Megatron: tensor-parallel peers,
        and pipeline stages where only the last computes the loss) reduces over all ranks instead
        and passes counts=False on every rank but one per share."""
        local = self.sums.cpu().tolist() + [tokens]
        reduced = all_reduce(local if counts else [0.0] * len(local), group=dp_group)
        g = dict(zip(_SUMS, reduced))
        aux = {"router_aux_loss": g["router_aux"]} if self.loss_config.router_aux_coef else {}
        return {
            "value_loss": g["loss"],
            "mse": 0.5 * g["res2"] / g["valid"] if g["valid"] else 0.0,  # unclipped, token-mean: the held-out loss
            "clip_fraction": g["clipped"] / g["valid"] if g["valid"] else 0.0,
            "explained_variance": explained_variance_from_sums(g["valid"], g["r"], g["r2"], g["res"], g["res2"]),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": reduced[-1] / seconds if seconds > 0 else float("nan"),
            "valid_tokens": g["valid"],
            **_mean_std("value", g["v"], g["v2"], g["valid"]),
            **_mean_std("return", g["r"], g["r2"], g["valid"]),
            **aux,
        }


def _mean_std(name: str, total: float, squares: float, count: float) -> dict:
    """Mean and (population) standard deviation from a sum and a sum of squares."""
    if not count:
        return {f"{name}/mean": 0.0, f"{name}/std": 0.0}
    mean = total / count
    return {f"{name}/mean": mean, f"{name}/std": max(squares / count - mean * mean, 0.0) ** 0.5}


def one_update(engine, batch: RolloutBatch, *, dp_group, counts: bool = True) -> dict:
    """`engine.update(batch)` for every backend: the mini-batch's gradients (engine.accumulate_gradients,
    a StepStats), one optimizer step at the rate the schedule gives this step (engine.step_optimizer),
    the schedule stepped, and the step's metrics over `dp_group` (`counts`: StepStats.metrics)."""
    start = time.perf_counter()
    stats = engine.accumulate_gradients(batch)
    lr = engine.scheduler.get_last_lr()[0]  # the rate this step uses
    grad_norm = engine.step_optimizer()
    engine.scheduler.step()
    return stats.metrics(grad_norm=grad_norm, lr=lr, tokens=float(batch.attention_mask.sum()),
                         seconds=time.perf_counter() - start, dp_group=dp_group, counts=counts)
