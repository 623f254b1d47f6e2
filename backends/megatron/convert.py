"""HF critic state dict <-> megatron-core GPTModel state dicts, sharded for tensor and pipeline parallel.

The mapping is data (LAYER_MAP, FIRST_STAGE_MAP, LAST_STAGE_MAP): megatron name -> (how it is
sharded or fused, the HF names it is made of). The HF side is always the critic of
common.valuehead.load_critic (every checkpoint format arrives as `model.*` + `score.weight/bias`),
and the way back produces the state dict common.valuehead.save_critic writes, so no format
knowledge lives here. Missing or leftover keys and shape mismatches are errors listing them.

Fusions (megatron 0.16, identical in mbridge 0.15.1 and verl):
  linear_qkv: per KV group g, [q rows of the group's heads; k_g; v_g], groups concatenated, so a
              tensor-parallel rank holds whole groups.
  linear_fc1: [gate; up]; rank r holds [gate.chunk(tp)[r]; up.chunk(tp)[r]].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch

from .config import FamilyTraits, head_dim

class Entry(NamedTuple):
    """One megatron tensor: how it is sharded or fused, and the HF tensors it is made of."""

    kind: str
    hf_names: tuple[str, ...]
    expert: int | None = None
    """For a routed expert's tensor (kinds expert_gate_up, expert_row): its row in the fused HF
    tensors (transformers 5 keeps every expert of a layer in one [experts, ...] tensor)."""


# megatron name (inside decoder.layers.{j}.) -> (kind, HF names inside model.layers.{i}.)
LAYER_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
}
DENSE_MLP_MAP = {
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
# An MoE layer's MLP (megatron-core's MoELayer with SequentialMLP experts): the router, then each
# local expert i (global expert ep_rank * local + i) from its row of the fused HF tensors.
ROUTER_MAP = {"mlp.router.weight": ("replicated", ("mlp.gate.weight",))}
EXPERT_MAP = {
    "linear_fc1.weight": ("expert_gate_up", ("mlp.experts.gate_up_proj",)),  # [experts, 2 * ffn, H]: gate; up
    "linear_fc2.weight": ("expert_row", ("mlp.experts.down_proj",)),  # [experts, H, ffn]
}
SHARED_EXPERT_MAP = {  # qwen2_moe
    "mlp.shared_experts.linear_fc1.weight": ("gate_up", ("mlp.shared_expert.gate_proj.weight",
                                                         "mlp.shared_expert.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_expert.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}
FIRST_STAGE_MAP = {"embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",))}
LAST_STAGE_MAP = {
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("replicated", ("score.weight",)),
    "output_layer.bias": ("replicated", ("score.bias",)),
}
# TransformerEngine's spec fuses the two norms into the linears that follow them (an MoE layer
# keeps its own pre-MLP norm).
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
EXPERT_KINDS = ("expert_gate_up", "expert_row")


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Where one rank's shard sits: tensor rank, pipeline stage and the HF layers it holds."""

    tp_rank: int
    tp_size: int
    first_layer: int
    num_layers: int
    pre_process: bool
    post_process: bool
    te_names: bool = False
    ep_rank: int = 0
    ep_size: int = 1
    """Expert parallelism: this rank holds routed experts [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Shapes:
    heads: int
    groups: int
    head_dim: int
    vocab: int
    padded_vocab: int

    @classmethod
    def of(cls, hf_config, tp_size: int) -> "Shapes":
        vocab = hf_config.vocab_size
        return cls(hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim(hf_config), vocab,
                   -(-vocab // tp_size) * tp_size)


def _layer_entries(traits: FamilyTraits, layer: int, layout: Layout) -> dict[str, Entry]:
    """megatron name (inside the layer) -> Entry with HF names inside model.layers.{layer}."""
    skip = set()
    if not traits.qkv_bias:
        skip.add("self_attention.linear_qkv.bias")
    if not traits.qk_norm:
        skip |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    moe = traits.moe if traits.moe is not None and traits.moe.moe_layers[layer] else None
    entries = {name: Entry(*entry) for name, entry in LAYER_MAP.items() if name not in skip}
    if moe is None:
        entries.update({name: Entry(*entry) for name, entry in DENSE_MLP_MAP.items()})
    else:
        entries.update({name: Entry(*entry) for name, entry in ROUTER_MAP.items()})
        local = moe.experts // layout.ep_size
        for i in range(local):
            for name, (kind, hf_names) in EXPERT_MAP.items():
                entries[f"mlp.experts.local_experts.{i}.{name}"] = Entry(kind, hf_names, layout.ep_rank * local + i)
        if moe.shared_ffn_size:
            entries.update({name: Entry(*entry) for name, entry in SHARED_EXPERT_MAP.items()})
    if layout.te_names:
        renames = dict(TE_NAMES) if moe is None else {"input_layernorm.weight": TE_NAMES["input_layernorm.weight"]}
        entries = {renames.get(name, name): entry for name, entry in entries.items()}
    return {name: entry._replace(hf_names=tuple(f"model.layers.{layer}.{n}" for n in entry.hf_names))
            for name, entry in entries.items()}


def stage_map(traits: FamilyTraits, layout: Layout) -> dict[str, Entry]:
    """megatron name -> Entry (kind, full HF names, expert row) for every tensor of this rank's stage."""
    entries = {name: Entry(*entry) for name, entry in FIRST_STAGE_MAP.items()} if layout.pre_process else {}
    for j in range(layout.num_layers):
        for name, entry in _layer_entries(traits, layout.first_layer + j, layout).items():
            entries[f"decoder.layers.{j}.{name}"] = entry
    if layout.post_process:
        entries.update({name: Entry(*entry) for name, entry in LAST_STAGE_MAP.items()})
    return entries


def expected_hf_keys(traits: FamilyTraits, num_layers: int) -> set[str]:
    full = Layout(0, 1, 0, num_layers, True, True)
    return {n for entry in stage_map(traits, full).values() for n in entry.hf_names}


def check_hf_keys(hf_state: dict[str, torch.Tensor], traits: FamilyTraits, num_layers: int) -> None:
    want = expected_hf_keys(traits, num_layers)
    missing, leftover = sorted(want - set(hf_state)), sorted(set(hf_state) - want)
    if missing or leftover:
        raise ValueError(f"the HF critic state dict does not match the megatron mapping: missing {missing}, "
                         f"unmapped {leftover}")


# -- to megatron -------------------------------------------------------------------------------------
def _fuse_qkv(q, k, v, s: Shapes) -> torch.Tensor:
    """[(heads + 2 groups) * d, ...] grouped per KV group; works for weights and biases."""
    per_group = s.heads // s.groups
    rest = q.shape[1:]
    q = q.reshape(s.groups, per_group * s.head_dim, *rest)
    k = k.reshape(s.groups, s.head_dim, *rest)
    v = v.reshape(s.groups, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1)  # (groups, (per_group + 2) * d, ...)


def _shard(kind: str, tensors: list[torch.Tensor], s: Shapes, tp_rank: int, tp_size: int) -> torch.Tensor:
    if kind == "replicated":
        return tensors[0]
    if kind == "qkv":
        fused = _fuse_qkv(*tensors, s)
        return fused.chunk(tp_size, dim=0)[tp_rank].flatten(0, 1)
    if kind == "gate_up":
        gate, up = tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    if kind == "row":
        return tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "vocab":
        weight = tensors[0]
        padded = weight.new_zeros(s.padded_vocab, *weight.shape[1:])
        padded[: s.vocab] = weight
        return padded.chunk(tp_size, dim=0)[tp_rank]
    raise AssertionError(kind)


def _rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """Rows of chunk `index` of `total` rows in `parts` (torch.chunk's split)."""
    size = -(-total // parts)
    return min(index * size, total), min((index + 1) * size, total)


def _read_shard(entry: Entry, read: Callable, rows_of: Callable[[str], int], s: Shapes,
                tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor rank's part of one megatron tensor, reading from the HF tensors only the rows it
    needs where its split is by rows (qkv: the rank's KV groups, gate/up, the vocabulary, a routed
    expert's row of the fused expert tensors); a row-parallel tensor (split by columns) reads its HF
    tensor whole, one at a time."""
    kind, hf_names = entry.kind, entry.hf_names
    if kind in EXPERT_KINDS:
        expert = read(hf_names[0], (entry.expert, entry.expert + 1))[0]
        if kind == "expert_gate_up":  # [gate; up] of this expert, each split over the tensor ranks
            return _shard("gate_up", list(expert.chunk(2, dim=0)), s, tp_rank, tp_size)
        return _shard("row", [expert], s, tp_rank, tp_size)
    if kind == "gate_up":
        return torch.cat([read(n, _rows(rows_of(n), tp_size, tp_rank)) for n in hf_names], dim=0)
    if kind == "qkv" and s.groups % tp_size == 0:  # whole KV groups per rank: their q, k and v rows
        groups, per_group = s.groups // tp_size, s.heads // s.groups
        first = tp_rank * groups
        q, k, v = hf_names
        local = dataclasses.replace(s, heads=groups * per_group, groups=groups)
        q_rows = per_group * s.head_dim
        return _fuse_qkv(read(q, (first * q_rows, (first + groups) * q_rows)),
                         read(k, (first * s.head_dim, (first + groups) * s.head_dim)),
                         read(v, (first * s.head_dim, (first + groups) * s.head_dim)), local).flatten(0, 1)
    if kind == "vocab":
        per_rank = s.padded_vocab // tp_size
        start, stop = tp_rank * per_rank, min((tp_rank + 1) * per_rank, s.vocab)
        part = read(hf_names[0], (start, max(start, stop)))
        if part.shape[0] == per_rank:  # no padding on this rank: no second copy of its rows
            return part
        padded = part.new_zeros(per_rank, *part.shape[1:])
        padded[: part.shape[0]] = part
        return padded
    return _shard(kind, [read(n, None) for n in hf_names], s, tp_rank, tp_size)


def read_partition(read: Callable[[str, tuple[int, int] | None], torch.Tensor], rows_of: Callable[[str], int],
                   hf_config, traits: FamilyTraits, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's megatron tensors, one at a time, from `read(hf_name, rows)` (common.valuehead.
    sliced.SlicedCritic.read: only the rows asked for; or a state dict's, state_reader) and
    `rows_of(hf_name)` (an HF tensor's row count). No more than one layer's HF tensors are ever read."""
    s = Shapes.of(hf_config, layout.tp_size)
    for mc_name, entry in stage_map(traits, layout).items():
        yield mc_name, _read_shard(entry, read, rows_of, s, layout.tp_rank, layout.tp_size).contiguous()


def state_reader(hf_state: dict[str, torch.Tensor]) -> tuple[Callable, Callable]:
    """(read, rows_of) of read_partition over a full HF state dict in memory."""
    return (lambda name, rows=None: hf_state[name] if rows is None else hf_state[name][rows[0]:rows[1]],
            lambda name: hf_state[name].shape[0])


def hf_to_mcore(hf_state: dict[str, torch.Tensor], hf_config, traits: FamilyTraits,
                layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's megatron state dict from the full HF critic state dict."""
    check_hf_keys(hf_state, traits, hf_config.num_hidden_layers)
    return {name: tensor.clone() for name, tensor in read_partition(*state_reader(hf_state), hf_config, traits, layout)}


def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
              names: Iterable[str] | None = None) -> None:
    """Copy a converted shard into the model, tensor by tensor as `tensors` yields them (a dict, or
    (name, tensor) pairs whose names are `names`): every parameter must be covered with its exact
    shape; the names are checked before anything is read."""
    if isinstance(tensors, dict):
        names, tensors = list(tensors), tensors.items()
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    names = set(names)
    missing, leftover = sorted(set(own) - names), sorted(names - set(own))
    if missing or leftover:
        raise ValueError(f"converted megatron state does not fit the model: missing {missing}, unmapped {leftover}")
    with torch.no_grad():
        for name, tensor in tensors:
            if own[name].shape != tensor.shape:
                raise ValueError(f"converted megatron state does not fit the model: shape mismatch {name}: model "
                                 f"{tuple(own[name].shape)} vs converted {tuple(tensor.shape)}")
            own[name].copy_(tensor)


def follow_frozen(model: torch.nn.Module, critic: torch.nn.Module, traits: FamilyTraits, layout: Layout) -> None:
    """Freeze each of this stage's converted megatron parameters whose HF sources the transforms
    froze (freeze_embeddings, freeze_backbone, LoRA's frozen base); ValueError when a fused megatron
    tensor (qkv, gate_up) has frozen and trainable sources, which cannot be split."""
    from ...common.engine.lora import base_state

    trainable = base_state({name: p.requires_grad for name, p in critic.named_parameters()})
    params = dict(model.named_parameters())
    for mc_name, entry in stage_map(traits, layout).items():
        hf_names = entry.hf_names
        flags = {trainable[name] for name in hf_names if name in trainable}
        if len(flags) > 1:
            raise ValueError(f"the transforms freeze some of {list(hf_names)} but not all; megatron fuses them into "
                             f"{mc_name}, which trains as a whole: freeze all of them or none")
        if mc_name in params and flags == {False}:
            params[mc_name].requires_grad_(False)


# -- back to HF --------------------------------------------------------------------------------------
def unshard(kind: str, shards: list[torch.Tensor], s: Shapes, name: str) -> list[torch.Tensor]:
    if kind == "replicated":
        for other in shards[1:]:
            if not torch.equal(other, shards[0]):
                raise ValueError(f"{name} differs between tensor-parallel ranks (it must be replicated)")
        return [shards[0]]
    if kind == "qkv":
        per_group = s.heads // s.groups
        fused = torch.cat(shards, dim=0)
        rest = fused.shape[1:]
        fused = fused.reshape(s.groups, (per_group + 2) * s.head_dim, *rest)
        q, k, v = fused.split([per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
        return [q.reshape(s.heads * s.head_dim, *rest), k.reshape(s.groups * s.head_dim, *rest),
                v.reshape(s.groups * s.head_dim, *rest)]
    if kind in ("gate_up", "expert_gate_up"):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate, up = torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)
        return [gate, up] if kind == "gate_up" else [torch.cat([gate, up], dim=0)]  # an expert's row: gate; up
    if kind in ("row", "expert_row"):
        return [torch.cat(shards, dim=1)]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: s.vocab]]
    raise AssertionError(kind)


def mcore_to_hf(shards: dict[object, dict[str, torch.Tensor]], layouts: dict[object, Layout],
                hf_config, traits: FamilyTraits) -> dict[str, torch.Tensor]:
    """The full HF critic state dict from every rank's megatron state: `shards` and `layouts` keyed
    alike (e.g. by (pp_rank, tp_rank)), one of each tensor rank of every pipeline stage and expert
    rank. A routed expert's tensors fill its row of the fused [experts, ...] HF tensors."""
    tp_size = next(iter(layouts.values())).tp_size
    s = Shapes.of(hf_config, tp_size)
    hf_state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    by_part: dict[tuple[int, int], dict[int, object]] = {}  # (first layer, ep rank) -> {tp rank: key}
    for key, layout in layouts.items():
        by_part.setdefault((layout.first_layer, layout.ep_rank), {})[layout.tp_rank] = key
    for (first_layer, ep_rank), keys in sorted(by_part.items()):
        ranks = [keys[tp] for tp in sorted(keys)]
        entries = stage_map(traits, layouts[ranks[0]])
        own = [{k: v for k, v in shards[r].items() if not k.endswith("_extra_state")} for r in ranks]
        leftover = sorted(set(own[0]) - set(entries))
        missing = sorted(set(entries) - set(own[0]))
        if missing or leftover:
            raise ValueError(f"pipeline stage from layer {first_layer}, expert rank {ep_rank}: megatron state missing "
                             f"{missing}, unmapped {leftover}")
        for mc_name, entry in entries.items():
            if entry.expert is None and ep_rank:
                continue  # expert ranks hold copies of everything but their experts
            tensors = unshard(entry.kind, [o[mc_name] for o in own], s, mc_name)
            for hf_name, tensor in zip(entry.hf_names, tensors):
                if entry.expert is None:
                    hf_state[hf_name] = tensor.contiguous()
                else:
                    experts.setdefault(hf_name, {})[entry.expert] = tensor
    for hf_name, rows in experts.items():
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"{hf_name}: the megatron states hold experts {sorted(rows)}, not every one")
        hf_state[hf_name] = torch.stack([rows[e] for e in range(len(rows))]).contiguous()
    check_hf_keys(hf_state, traits, hf_config.num_hidden_layers)
    return hf_state
