"""LoRA on megatron-core's parallel linears: our own small adapter module beside each adapted
linear, its A/B tensor-parallel-sharded where the linear is, converted to and from peft's names.

Each HF projection peft adapts (q/k/v/o/gate/up/down_proj) is one part of a megatron linear:
  linear_qkv (column-parallel, fused per KV group)  <- q_proj, k_proj, v_proj
  linear_proj (row-parallel)                        <- o_proj
  linear_fc1 (column-parallel, [gate; up])          <- gate_proj, up_proj
  linear_fc2 (row-parallel)                         <- down_proj
A part's delta is scale * B @ A @ dropout(x), added to the linear's output by a forward hook, so
the base linear, its names and its checkpoint layout stay megatron's own.

Tensor parallel, per part (the math of megatron's own linears, applied to the rank-r bottleneck):
  column: A [r, in] replicated, B [out/tp, r] = HF B's row chunk (a rank's fused-qkv rows are its
          KV groups, whose q, k, v rows are each a contiguous chunk). h = A x goes through
          copy-to-TP (backward all-reduce), so A and x get whole gradients; under sequence
          parallelism h is gathered over the sequence instead, and A's gradient (over this rank's
          tokens) is summed over the TP group by finalize_model_grads (`sequence_parallel`).
  row:    A [r, in/tp] = HF A's column chunk, B [out, r] replicated; h = A x is all-reduced (or
          reduce-scattered over the sequence under SP, with B's gradient then summed likewise).
The adapter parameters are `<linear>_lora.lora_A_<part>` / `lora_B_<part>` on the linear's parent.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from ...common.engine.config import LoRAConfig
from ...common.engine.lora import ADAPTER



@dataclasses.dataclass(frozen=True, slots=True)
class AdaptedLinear:
    parent: str
    """The linear's parent inside a TransformerLayer (megatron names)."""
    linear: str
    column: bool
    """Column-parallel (output sharded) or row-parallel (input sharded)."""
    parts: tuple[str, ...]
    """The HF modules (inside model.layers.{i}.) it fuses, in its output order."""


ADAPTED = (
    AdaptedLinear("self_attention", "linear_qkv", True, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    AdaptedLinear("self_attention", "linear_proj", False, ("self_attn.o_proj",)),
    AdaptedLinear("mlp", "linear_fc1", True, ("mlp.gate_proj", "mlp.up_proj")),
    AdaptedLinear("mlp", "linear_fc2", False, ("mlp.down_proj",)),
)


def _leaf(part: str) -> str:
    return part.rsplit(".", 1)[-1]


class LinearLoRA(torch.nn.Module):
    """The adapters of one megatron linear (its targeted parts); `delta(x)` is what they add to its output."""

    def __init__(self, spec: AdaptedLinear, lora: LoRAConfig, *, in_features: int, part_out: dict[str, int],
                 tp_size: int, sequence_parallel: bool, groups_local: int, dtype: torch.dtype):
        super().__init__()
        self.spec, self.tp_size, self.sequence_parallel = spec, tp_size, sequence_parallel and tp_size > 1
        self.scale = lora.alpha / lora.rank
        self.dropout = lora.dropout
        self.groups_local = groups_local
        self.part_out = part_out  # this rank's output width of each part
        self.parts = [p for p in spec.parts if _leaf(p) in lora.target_modules]
        r = lora.rank
        in_local = in_features if spec.column else in_features // tp_size
        for part in self.parts:
            leaf = _leaf(part)
            a = torch.nn.Parameter(torch.zeros(r, in_local, dtype=dtype))
            b = torch.nn.Parameter(torch.zeros(part_out[part], r, dtype=dtype))
            sharded, dim = (b, 0) if spec.column else (a, 1)
            set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=dim, stride=1)
            replicated = a if spec.column else b
            if self.sequence_parallel:  # its gradient covers this rank's tokens only: summed over TP
                replicated.sequence_parallel = True
            self.register_parameter(f"lora_A_{leaf}", a)
            self.register_parameter(f"lora_B_{leaf}", b)

    def _bottleneck(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = F.linear(F.dropout(x, self.dropout, self.training) if self.dropout else x, a)
        if self.tp_size == 1:
            return h
        if self.spec.column:
            return gather_from_sequence_parallel_region(h) if self.sequence_parallel \
                else copy_to_tensor_model_parallel_region(h)
        return reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel \
            else reduce_from_tensor_model_parallel_region(h)

    def delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """What the adapters add to the linear's output `out` (the same shape)."""
        deltas = {}
        for part in self.parts:
            leaf = _leaf(part)
            h = self._bottleneck(x, getattr(self, f"lora_A_{leaf}"))
            deltas[part] = F.linear(h, getattr(self, f"lora_B_{leaf}")) * self.scale
        if not self.spec.column or len(self.spec.parts) == 1:
            return deltas[self.spec.parts[0]].to(out.dtype)
        full = [deltas.get(p, out.new_zeros(*out.shape[:-1], self.part_out[p])) for p in self.spec.parts]
        if self.spec.linear == "linear_qkv":  # per KV group: [q rows of the group's heads; k; v]
            full = [d.reshape(*d.shape[:-1], self.groups_local, -1) for d in full]
            return torch.cat(full, dim=-1).flatten(-2).to(out.dtype)
        return torch.cat(full, dim=-1).to(out.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """dist_checkpointing tensors: the TP-sharded factor of each part along its split dimension."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {f"lora_{'B' if self.spec.column else 'A'}_{_leaf(p)}": 0 if self.spec.column else 1
                for p in self.parts}
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


def _hook(adapter: LinearLoRA):
    def add_delta(module, args, output):
        out, bias = output
        # In place: the output keeps the linear's memory layout, so what follows computes exactly as
        # without adapters (a fresh contiguous sum picks other kernels: ~1e-7 apart at TP 2).
        return out + adapter.delta(args[0], out), bias
    return add_delta


def inject(model: torch.nn.Module, lora: LoRAConfig, hf_config, tp_size: int, sequence_parallel: bool) -> None:
    """Add the adapters to every decoder layer of this stage and freeze all but them and the value head."""
    from .config import head_dim

    d = head_dim(hf_config)
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    hidden, ffn = hf_config.hidden_size, hf_config.intermediate_size
    out = {"self_attn.q_proj": heads * d // tp_size, "self_attn.k_proj": groups * d // tp_size,
           "self_attn.v_proj": groups * d // tp_size, "self_attn.o_proj": hidden,
           "mlp.gate_proj": ffn // tp_size, "mlp.up_proj": ffn // tp_size, "mlp.down_proj": hidden}
    inputs = {"linear_qkv": hidden, "linear_proj": heads * d, "linear_fc1": hidden, "linear_fc2": ffn}
    dtype = next(model.parameters()).dtype
    for param in model.parameters():
        param.requires_grad_(False)
    for layer in model.decoder.layers:
        for spec in ADAPTED:
            if not any(_leaf(p) in lora.target_modules for p in spec.parts):
                continue
            parent = getattr(layer, spec.parent)
            adapter = LinearLoRA(spec, lora, in_features=inputs[spec.linear], part_out=out, tp_size=tp_size,
                                 sequence_parallel=sequence_parallel, groups_local=groups // tp_size, dtype=dtype)
            parent.add_module(f"{spec.linear}_lora", adapter)
            getattr(parent, spec.linear).register_forward_hook(_hook(adapter))
    if getattr(model, "output_layer", None) is not None:  # the value head trains in full
        for param in model.output_layer.parameters():
            param.requires_grad_(True)


# -- peft's names (the HF critic with peft's layers injected, common/engine/lora.py) <-> our adapters ------------
def _hf_key(layer: int, part: str, factor: str) -> str:
    return f"model.layers.{layer}.{part}.lora_{factor}.{ADAPTER}.weight"


def adapter_names(lora: LoRAConfig, first_layer: int, num_layers: int):
    """(megatron name, HF name, factor, column) of every adapter tensor of a stage."""
    for j in range(num_layers):
        for spec in ADAPTED:
            for part in spec.parts:
                if _leaf(part) not in lora.target_modules:
                    continue
                for factor in ("A", "B"):
                    yield (f"decoder.layers.{j}.{spec.parent}.{spec.linear}_lora.lora_{factor}_{_leaf(part)}",
                           _hf_key(first_layer + j, part, factor), factor, spec.column)


def _sharded(factor: str, column: bool) -> int | None:
    """The dimension a factor is split along over the TP ranks (None: replicated)."""
    if column:
        return 0 if factor == "B" else None
    return 1 if factor == "A" else None


def hf_to_megatron(hf_state: dict[str, torch.Tensor], lora: LoRAConfig, layout) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors from the injected HF critic's full `...lora_A.default.weight` ones."""
    out = {}
    for mc_name, hf_name, factor, column in adapter_names(lora, layout.first_layer, layout.num_layers):
        tensor, dim = hf_state[hf_name], _sharded(factor, column)
        out[mc_name] = (tensor if dim is None else tensor.chunk(layout.tp_size, dim=dim)[layout.tp_rank]).clone()
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], lora: LoRAConfig, layout) -> dict[str, torch.Tensor]:
    """The full HF adapter tensors of one pipeline stage from its TP ranks' states (tp order)."""
    out = {}
    for mc_name, hf_name, factor, column in adapter_names(lora, layout.first_layer, layout.num_layers):
        dim = _sharded(factor, column)
        out[hf_name] = shards[0][mc_name] if dim is None else torch.cat([s[mc_name] for s in shards], dim=dim)
    return out


def is_adapter_key(name: str) -> bool:
    return "_lora.lora_" in name

