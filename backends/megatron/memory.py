"""What one rank of a megatron critic engine holds, from the config alone (common.engine.memory's
count for this backend: BackendSpec.state_memory). No megatron-core import: the layout rules below
are megatron-core 0.16's (distributed/param_and_grad_buffer.py, optimizer/distrib_optimizer.py),
applied to this rank's tensors as convert.py (and lora.py, for adapters) shards them.

  tensors     this rank's megatron tensors (convert.read_partition over the HF critic on the meta
              device: the stage's layers, its tensor-parallel shard, its routed experts) in the
              order the local layer spec registers them (MODULE_ORDER), frozen where the engine's
              transforms freeze their HF sources (convert.follow_frozen's rule)
  DDP buffers the trainable tensors, in reverse order, one buffer for the dense ones (sharded over
              data x context) and one for the routed experts (over the expert-data group); with the
              distributed optimizer each tensor starts at a multiple of 64 elements and the buffer
              ends at a multiple of lcm(ranks, 128). Gradients: fp32 (grad_reduce_in_fp32).
  parameters  the parameter buffers (distributed optimizer: every parameter is a view of one) and
              the frozen tensors; without it every tensor is its own storage
  optimizer   Adam's two fp32 moments, a 4-byte step and (bf16 models) an fp32 main copy per
              tensor, of the whole tensor, or with the distributed optimizer of the part of the
              buffer this data-parallel rank owns (its 1 / ranks of each buffer); none while
              engine.optim.offload_state keeps the state in host memory

TransformerEngine's layer spec (CUDA) fuses the norms into the next linear: the same bytes, the
64-element alignment aside. Checked against resident_bytes() by the conformance tests (DP 2, TP 2,
PP 2, CP 2) and the MoE critic's.
"""

from __future__ import annotations

import dataclasses
import math

import torch

# The order of a TransformerLayer's parameters in the local layer spec (value_model.local_layer_spec):
# megatron's Attention builds linear_proj before SelfAttention adds linear_qkv and the q/k norms.
# LoRA's adapters (lora.inject) are modules added to the linear's parent after its own.
MODULE_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                "self_attention.q_layernorm.", "self_attention.k_layernorm.", "self_attention.linear_qkv_lora.",
                "self_attention.linear_proj_lora.", "pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc2.",
                "mlp.linear_fc1_lora.", "mlp.linear_fc2_lora.", "mlp.router.", "mlp.experts.", "mlp.shared_experts.")
PARAM_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128
ADAM_STEP_BYTES = 4


@dataclasses.dataclass(frozen=True, slots=True)
class RankTensor:
    name: str
    numel: int
    trainable: bool
    expert: bool
    """A routed expert's (DDP reduces it over the expert-data group, in a buffer of its own)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Coordinates:
    tensor: int
    pipeline: int
    data: int
    """The rank's index in its data x context group (the dense buffer's shards)."""
    expert: int
    expert_data: int
    """Its index in its expert-data group (the expert buffer's shards)."""


def coordinates(parallel, world_size: int, rank: int) -> tuple[Coordinates, int, int]:
    """(where global `rank` sits, data x context ranks, expert-data ranks) on the engine's mesh, whose
    ranks are laid out over common.engine.mesh.DIMS (pipeline, data, context, ulysses, tensor: tensor
    innermost) and whose expert groups split each stage's data x context ranks (mesh_groups.expert_groups)."""
    per_stage = world_size // parallel.pipeline
    in_stage = rank % per_stage
    dense = per_stage // parallel.tensor
    data = in_stage // parallel.tensor
    where = Coordinates(tensor=in_stage % parallel.tensor, pipeline=rank // per_stage, data=data,
                        expert=data % parallel.expert, expert_data=data // parallel.expert)
    return where, dense, dense // parallel.expert


def _registration_key(name: str) -> tuple[int, int, int, int]:
    """Sort key of a megatron tensor name by where its module registers it (a stable sort keeps
    convert.stage_map's order among equal keys: weight before bias, fc1 before fc2)."""
    if not name.startswith("decoder.layers."):
        return (0 if name.startswith("embedding.") else 2, 0, 0, 0)
    layer, rest = name[len("decoder.layers."):].split(".", 1)
    position = next((i for i, prefix in enumerate(MODULE_ORDER) if rest.startswith(prefix)), len(MODULE_ORDER))
    expert = int(rest.split(".")[3]) if rest.startswith("mlp.experts.local_experts.") else 0
    return (1, int(layer), position, expert)


def rank_tensors(engine_config, critic_config, where: Coordinates) -> list[RankTensor]:
    """This rank's megatron tensors, in the order the model registers them."""
    from ...common.engine.lora import base_state
    from ...common.engine.memory import meta_critic
    from . import convert
    from .config import family_traits

    parallel = engine_config.parallel
    critic = meta_critic(engine_config, critic_config)
    traits = family_traits(critic.config)
    per_stage = critic.config.num_hidden_layers // parallel.pipeline
    layout = convert.Layout(where.tensor, parallel.tensor, where.pipeline * per_stage, per_stage,
                            where.pipeline == 0, where.pipeline == parallel.pipeline - 1,
                            ep_rank=where.expert, ep_size=parallel.expert)
    state = base_state(dict(critic.named_parameters()))
    trainable = {name: p.requires_grad for name, p in state.items()}
    entries = convert.stage_map(traits, layout)
    tensors = []
    for name, tensor in convert.read_partition(*convert.state_reader(state), critic.config, traits, layout):
        flags = {trainable[hf] for hf in entries[name].hf_names if hf in trainable}
        tensors.append(RankTensor(name, tensor.numel(), flags != {False}, ".mlp.experts." in name))
    if engine_config.lora.rank:  # the adapters train, the base is frozen (lora.inject); megatron's lora imports megatron
        from . import lora

        adapters = lora.hf_to_megatron(dict(critic.named_parameters()), engine_config.lora, layout)
        tensors = [dataclasses.replace(t, trainable=t.name.startswith("output_layer.")) for t in tensors]
        tensors += [RankTensor(name, tensor.numel(), True, False) for name, tensor in adapters.items()]
    return sorted(tensors, key=lambda t: _registration_key(t.name))


def _pad(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def buffer_layout(numels: list[int], ranks: int, distributed: bool) -> tuple[list[tuple[int, int]], int]:
    """([(start, end)] of each tensor in DDP's buffer, its padded size) for tensors in registration
    order (the buffer takes them in reverse: roughly the backward's order)."""
    spans, start = [None] * len(numels), 0
    for index in reversed(range(len(numels))):
        if distributed:
            start = _pad(start, PARAM_ALIGNMENT)
        spans[index] = (start, start + numels[index])
        start += numels[index]
    return spans, _pad(start, math.lcm(ranks, BUCKET_ALIGNMENT)) if distributed else start


def state_memory(engine_config, critic_config, world_size: int, rank: int | None = 0) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes of global `rank` (None: the rank holding the most), as
    the engine's resident_bytes() reports them once a step has run (gradients: held from the backward
    to the next zero_grad)."""
    if rank is None:
        rank = largest_rank(engine_config, critic_config, world_size)
    parallel, optim = engine_config.parallel, engine_config.optim
    where, dense_ranks, expert_ranks = coordinates(parallel, world_size, rank)
    tensors = rank_tensors(engine_config, critic_config, where)
    bf16 = engine_config.mixed_precision == "bf16" or engine_config.model.dtype == "bfloat16"
    element = 2 if bf16 else 4
    distributed = optim.distributed_optimizer
    params = grads = optimizer = 0
    per_tensor_state = 2 * 4 + (4 if bf16 else 0)  # exp_avg, exp_avg_sq (+ the fp32 main copy)
    for expert, ranks, own in ((False, dense_ranks, where.data), (True, expert_ranks, where.expert_data)):
        members = [t for t in tensors if t.trainable and t.expert == expert]
        if not members:
            continue
        spans, size = buffer_layout([t.numel for t in members], ranks, distributed)
        grads += size * 4
        if not distributed:
            params += sum(t.numel for t in members) * element
            optimizer += sum(t.numel * per_tensor_state + ADAM_STEP_BYTES for t in members)
            continue
        params += size * element
        share = size // ranks
        lo, hi = own * share, (own + 1) * share
        for start, end in spans:
            owned = min(end, hi) - max(start, lo)
            if owned > 0:
                optimizer += owned * per_tensor_state + ADAM_STEP_BYTES
    params += sum(t.numel for t in tensors if not t.trainable) * element
    return params, grads, 0 if optim.offload_state else optimizer


def largest_rank(engine_config, critic_config, world_size: int) -> int:
    """The global rank with the most bytes: each pipeline stage's first rank (tensor ranks hold
    equal shards, the first data-parallel rank the largest share), the largest of those."""
    per_stage = world_size // engine_config.parallel.pipeline
    firsts = range(0, world_size, per_stage)
    return max(firsts, key=lambda rank: sum(state_memory(engine_config, critic_config, world_size, rank)))


# Korthikanti et al. (Megatron-LM's theoretical_memory_usage): of a layer's 34 s*b*h activation bytes (fp16),
# 10 are its norms' inputs, dropout masks and the residual, which tensor parallelism splits only with
# sequence parallelism; the other 24 it splits always.
_REPLICATED_PER_LAYER, _SPLIT_PER_LAYER = 10, 24


def tensor_share(parallel) -> float:
    """The fraction of a layer's activations one tensor rank keeps: with sequence parallelism 1 / tensor,
    else 24 of every 34 parts split."""
    if parallel.tensor == 1:
        return 1.0
    if parallel.sequence_parallel:
        return 1.0 / parallel.tensor
    return (_REPLICATED_PER_LAYER + _SPLIT_PER_LAYER / parallel.tensor) / (_REPLICATED_PER_LAYER + _SPLIT_PER_LAYER)


def _layers(model, count: int) -> torch.nn.Module:
    """The meta-device critic `model` with its first `count` decoder layers only."""
    import copy

    from ...common.valuehead.config import critic_class

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = count
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists some families keep
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:count])
    with torch.device("meta"):
        return critic_class(config)(config).to(next(model.parameters()).dtype)


def activation_memory(engine_config, model, tokens: int, checkpointing: bool) -> int | None:
    """BackendSpec.activation_memory: the HF critic's count (common.engine.memory.activation_bytes) split
    into a layer's part and the rest (the head's, on the last stage), with what the local layer spec keeps
    besides per layer and token (measured with the saved-for-backward counter): one more
    intermediate-wide tensor (its SwiGLU keeps fc1's [gate; up] output whole, besides what transformers'
    gate and up projections keep) and the rotary cos/sin of q and of k in fp32. Under 1F1B pipeline stage
    s holds (pipeline - s) micro-batches of its layers in flight: the first stage the whole model's layers,
    the last one micro-batch's and the head's; the largest stage counts. Tensor ranks keep their share of a
    layer's (tensor_share); with full recompute a layer keeps its input only, split over the tensor ranks
    with sequence parallelism only."""
    from ...common.engine.memory import activation_bytes

    one, two = (activation_bytes(_layers(model, n), tokens, checkpointing=checkpointing) for n in (1, 2))
    if one is None or two is None:
        return None
    per_layer, rest = two - one, 2 * one - two
    config, parallel = model.config, engine_config.parallel
    if not checkpointing:
        element = torch.finfo(next(model.parameters()).dtype).bits // 8
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_layer += tokens * (config.intermediate_size * element + 4 * head_dim * 4)
    sequence_split = 1 / parallel.tensor if parallel.sequence_parallel else 1.0
    per_layer *= sequence_split if checkpointing else tensor_share(parallel)
    rest *= sequence_split
    stages, layers = parallel.pipeline, config.num_hidden_layers // parallel.pipeline
    return int(max((stages - stage) * layers * per_layer + (rest if stage == stages - 1 else 0)
                   for stage in range(stages)))
