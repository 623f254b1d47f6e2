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

import torch

from .config import FamilyTraits, head_dim

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
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
FIRST_STAGE_MAP = {"embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",))}
LAST_STAGE_MAP = {
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("replicated", ("score.weight",)),
    "output_layer.bias": ("replicated", ("score.bias",)),
}
# TransformerEngine's spec fuses the two norms into the linears that follow them.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


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


def _layer_entries(traits: FamilyTraits) -> dict[str, tuple[str, tuple[str, ...]]]:
    skip = set()
    if not traits.qkv_bias:
        skip.add("self_attention.linear_qkv.bias")
    if not traits.qk_norm:
        skip |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    return {name: entry for name, entry in LAYER_MAP.items() if name not in skip}


def stage_map(traits: FamilyTraits, layout: Layout) -> dict[str, tuple[str, tuple[str, ...]]]:
    """megatron name -> (kind, full HF names) for every tensor of this rank's stage."""
    entries = dict(FIRST_STAGE_MAP) if layout.pre_process else {}
    for j in range(layout.num_layers):
        i = layout.first_layer + j
        for name, (kind, hf_names) in _layer_entries(traits).items():
            mc_name = TE_NAMES.get(name, name) if layout.te_names else name
            entries[f"decoder.layers.{j}.{mc_name}"] = (kind, tuple(f"model.layers.{i}.{n}" for n in hf_names))
    if layout.post_process:
        entries.update(LAST_STAGE_MAP)
    return entries


def expected_hf_keys(traits: FamilyTraits, num_layers: int) -> set[str]:
    full = Layout(0, 1, 0, num_layers, True, True)
    return {n for _, names in stage_map(traits, full).values() for n in names}


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


def _read_shard(kind: str, hf_names: tuple[str, ...], read: Callable, rows_of: Callable[[str], int], s: Shapes,
                tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor rank's part of one megatron tensor, reading from the HF tensors only the rows it
    needs where its split is by rows (qkv: the rank's KV groups, gate/up, the vocabulary); a
    row-parallel tensor (split by columns) reads its HF tensor whole, one at a time."""
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
    for mc_name, (kind, hf_names) in stage_map(traits, layout).items():
        yield mc_name, _read_shard(kind, hf_names, read, rows_of, s, layout.tp_rank, layout.tp_size).contiguous()


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
    for mc_name, (_, hf_names) in stage_map(traits, layout).items():
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
    if kind == "gate_up":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: s.vocab]]
    raise AssertionError(kind)


def mcore_to_hf(shards: dict[tuple[int, int], dict[str, torch.Tensor]], layouts: dict[tuple[int, int], Layout],
                hf_config, traits: FamilyTraits) -> dict[str, torch.Tensor]:
    """The full HF critic state dict from every rank's megatron state, keyed by (pp_rank, tp_rank)."""
    tp_size = next(iter(layouts.values())).tp_size
    s = Shapes.of(hf_config, tp_size)
    hf_state: dict[str, torch.Tensor] = {}
    for pp_rank in sorted({pp for pp, _ in layouts}):
        ranks = [(pp_rank, tp) for tp in range(tp_size)]
        entries = stage_map(traits, layouts[ranks[0]])
        own = [{k: v for k, v in shards[r].items() if not k.endswith("_extra_state")} for r in ranks]
        leftover = sorted(set(own[0]) - set(entries))
        missing = sorted(set(entries) - set(own[0]))
        if missing or leftover:
            raise ValueError(f"pipeline stage {pp_rank}: megatron state missing {missing}, unmapped {leftover}")
        for mc_name, (kind, hf_names) in entries.items():
            for hf_name, tensor in zip(hf_names, unshard(kind, [o[mc_name] for o in own], s, mc_name)):
                hf_state[hf_name] = tensor.contiguous()
    check_hf_keys(hf_state, traits, hf_config.num_hidden_layers)
    return hf_state
