"""The router load-balancing loss of a mixture-of-experts critic (engine.loss.router_aux_coef).

What transformers adds to a MoE causal LM's loss (`router_aux_loss_coef * load_balancing_loss_func`:
Switch Transformer's E * sum_e f_e * P_e over the router logits of every MoE layer of one forward
pass, real tokens only), computed with transformers' own function on the router logits the engine
captured. Engines add `coef * aux / (micro-batches in the step)` to each micro-batch's loss: the
step's objective is the value loss plus the coefficient times the mean aux loss of its forward passes.
The update's metrics report that mean, without the coefficient, as `router_aux_loss`; `value_loss`
stays the value loss alone (docs/METRICS.md).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..parallel.distributed import all_reduce


def is_router(name: str) -> bool:
    """transformers' (and VeOmni's) router of a MoE layer: `<layer>.mlp.gate` (not qwen2_moe's
    shared_expert_gate)."""
    return name.endswith(".mlp.gate")


@contextlib.contextmanager
def captured(model: torch.nn.Module, *, select=is_router, logits_of=None):
    """Yields a list that fills, during forwards inside the block, with each selected router's logits in
    forward order (output, or output[0] when it returns a tuple; `logits_of(module, inputs, output)`
    to compute them instead)."""
    found: list[torch.Tensor] = []

    def hook(module, inputs, output):
        if logits_of is not None:
            found.append(logits_of(module, inputs, output))
        else:
            found.append(output[0] if isinstance(output, tuple) else output)

    handles = [module.register_forward_hook(hook) for name, module in model.named_modules() if select(name)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def load_balancing_loss(per_layer: list[torch.Tensor], mask: torch.Tensor, *, experts: int, top_k: int
                        ) -> torch.Tensor:
    """transformers' load_balancing_loss_func over the real tokens: `per_layer`, one [rows, T, E]
    logits tensor per MoE layer laid out like the rows (`mask` [rows, T], 1 on real tokens)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    real = mask.bool().to(per_layer[0].device)
    return load_balancing_loss_func(tuple(logits[real] for logits in per_layer), experts, top_k)


def aux_experts(coef: float, model_config, *, refuse: str | None = None):
    """The critic's common.valuehead.experts.Experts when engine.loss.router_aux_coef is on, else None;
    ValueError for a dense model, or with `refuse` (why this layout cannot compute it)."""
    if not coef:
        return None
    from ..valuehead.experts import experts_of

    experts = experts_of(model_config)
    if experts is None:
        raise ValueError(f"engine.loss.router_aux_coef={coef}: {model_config.model_type} has no router (a dense "
                         f"model); set engine.loss.router_aux_coef=0")
    if refuse:
        raise ValueError(f"engine.loss.router_aux_coef={coef} {refuse}; set engine.loss.router_aux_coef=0 or "
                         f"change the layout")
    return experts


@dataclasses.dataclass(frozen=True)
class StepAux:
    """One update step's router loss: capture each micro-batch's router logits, then add
    `coef * aux / count` to its loss, `count` being the micro-batches with rows over the
    data-parallel ranks. Off (no experts): captures nothing and adds 0."""

    coef: float
    experts: object  # common.valuehead.experts.Experts, or None when off
    count: int

    @classmethod
    def of(cls, coef: float, experts, micro_batches, group) -> "StepAux":
        if experts is None:
            return cls(0.0, None, 1)
        (count,) = all_reduce([float(sum(1 for mb in micro_batches if mb.rows))], group=group)
        return cls(coef, experts, int(count))

    def capture(self, model: torch.nn.Module, **kwargs):
        """captured(model, **kwargs) when on; else a block that yields an empty list."""
        return captured(model, **kwargs) if self.experts is not None else contextlib.nullcontext([])

    def term(self, mb, per_layer: list[torch.Tensor], attention_mask: torch.Tensor, row_length: int, stats):
        """The micro-batch's share of the step's router loss, `coef * aux / count`, counted without the
        coefficient in `stats` (common.engine.update_step.StepStats: the metric router_aux_loss).
        `per_layer`: its [b, t, E] logits laid out like the model's input
        (common.parallel.batching.MicroBatch.unpack maps them to its rows)."""
        if self.experts is None:
            return 0.0
        rows = [mb.unpack(logits, row_length) for logits in per_layer]
        aux = load_balancing_loss(rows, attention_mask[mb.rows], experts=self.experts.routed, top_k=self.experts.top_k)
        share = aux / self.count
        stats.add_router_aux(share)
        return self.coef * share
