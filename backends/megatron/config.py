"""The one boundary between our configs and megatron-core's: HF config + EngineConfig ->
TransformerConfig and GPTModel arguments, with every unsupported combination refused up front.

`check_megatron_config` runs before any process-group work, so a bad family or parallel layout is
a ValueError naming the key and the fix, never a hang or an assertion deep inside megatron.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from ...common.engine.config import EngineConfig, ParallelConfig

# Families whose HF layout maps onto a megatron-core GPTModel with our converter (convert.py):
# RMSNorm, SwiGLU, rotary, GQA; what differs between them is only the attention extras.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True, slots=True)
class FamilyTraits:
    qkv_bias: bool
    """q/k/v projections carry a bias (qwen2 always; llama/mistral/qwen3 when attention_bias)."""
    qk_norm: bool
    """RMSNorm over each query/key head (qwen3)."""


def family_traits(hf_config: PretrainedConfig) -> FamilyTraits:
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"the megatron backend does not support model_type={model_type!r}; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)} (use backend=fsdp for other families)")
    if model_type == "qwen2":
        return FamilyTraits(qkv_bias=True, qk_norm=False)
    return FamilyTraits(qkv_bias=bool(getattr(hf_config, "attention_bias", False)), qk_norm=model_type == "qwen3")


def head_dim(hf_config: PretrainedConfig) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def rope_theta(hf_config: PretrainedConfig) -> float:
    """The rotary base; transformers 5 keeps it only in rope_parameters."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{hf_config.model_type} with rope_type={rope_type!r} is not supported by the megatron "
                         f"backend yet (only default rotary); use backend=fsdp")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"{hf_config.model_type} config has no rope_theta in rope_parameters")
    return float(theta)


def check_megatron_config(hf_config: PretrainedConfig, parallel: ParallelConfig, world_size: int) -> FamilyTraits:
    """Raise a ValueError naming the key and the fix for anything this backend cannot run."""
    traits = family_traits(hf_config)
    rope_theta(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: the megatron backend builds SwiGLU MLPs (silu) only")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by the megatron backend (megatron's add_bias_linear "
                         "would also add biases to the attention output); use backend=fsdp")
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and getattr(hf_config, "use_sliding_window", True) and window < hf_config.max_position_embeddings:
        raise ValueError(f"sliding_window={window} is not supported by the megatron backend; use backend=fsdp")
    heads, groups, layers = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.num_hidden_layers
    tp, pp = parallel.tensor, parallel.pipeline
    if heads % tp or groups % tp:
        raise ValueError(f"engine.parallel.tensor={tp} must divide the attention heads ({heads}) and the key/value "
                         f"heads ({groups}) of {hf_config.model_type}; pick a divisor of {groups}")
    if hf_config.intermediate_size % tp:
        raise ValueError(f"engine.parallel.tensor={tp} must divide intermediate_size={hf_config.intermediate_size}")
    if pp > layers:
        raise ValueError(f"engine.parallel.pipeline={pp} is more than the model's {layers} layers; use at most {layers}")
    if layers % pp:
        raise ValueError(f"engine.parallel.pipeline={pp} must divide the model's {layers} layers evenly")
    if parallel.sequence_parallel and tp == 1:
        raise ValueError("engine.parallel.sequence_parallel=true needs engine.parallel.tensor > 1 (megatron splits "
                         "the sequence over the tensor-parallel ranks); set tensor: 2 or sequence_parallel: false")
    if parallel.ulysses != 1:
        raise ValueError(f"engine.parallel.ulysses={parallel.ulysses}: the megatron backend splits sequences with "
                         f"context parallelism instead; set engine.parallel.context={parallel.ulysses}, ulysses=1")
    cp = parallel.context
    if world_size % (tp * pp * cp):
        raise ValueError(f"the world of {world_size} processes is not a multiple of engine.parallel.tensor * "
                         f"pipeline * context = {tp * pp * cp}; launch a multiple of {tp * pp * cp} processes")
    return traits


def check_layout(hf_config: PretrainedConfig, config: EngineConfig, world_size: int) -> None:
    """The BackendSpec hook (common/engine/registry.py): what check_megatron_config refuses, before any
    process starts (the launcher's and dry run's check)."""
    check_megatron_config(hf_config, config.parallel, world_size)
    check_megatron_transforms(config.transforms)
    if config.lora.rank:
        check_megatron_targets(config.lora.target_modules)


# The HF projections the megatron backend's LoRA adapts (lora.py: one adapter per part of a megatron linear).
MEGATRON_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_megatron_targets(target_modules) -> None:
    other = [target for target in target_modules if target not in MEGATRON_LORA_TARGETS]
    if other:
        raise ValueError(f"engine.lora.target_modules names {other}: the megatron backend adapts only "
                         f"{', '.join(MEGATRON_LORA_TARGETS)}; use backend=fsdp for other modules")


def check_megatron_transforms(names) -> None:
    """engine.transforms on megatron: transforms that only freeze parameters. The critic is converted
    to megatron's module by parameter name (convert.py), so a transform that adds or renames
    parameters (one with `to_plain`) has no megatron form; LoRA has its own (lora.py)."""
    from ...common.engine.transforms import resolve_transforms

    rewriting = [name for name, t in zip(names, resolve_transforms(names)) if t.to_plain is not None]
    if rewriting:
        raise ValueError(f"engine.transforms names {rewriting}, which add or rename parameters: the megatron backend "
                         f"converts the HF critic's parameters by name and takes transforms that only freeze "
                         f"(freeze_embeddings, freeze_backbone, ...); use backend fsdp or veomni for this one")


def transformer_config(hf_config: PretrainedConfig, config: EngineConfig, *, cpu: bool):
    """The megatron TransformerConfig of this critic (fusions off and CPU init on CPU)."""
    from megatron.core.transformer import TransformerConfig

    traits = family_traits(hf_config)
    parallel = config.parallel
    bf16 = config.mixed_precision == "bf16" or config.model.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if config.gradient_checkpointing else {}
    return TransformerConfig(
        cuda_graph_scope=[],  # the whole layer (its default, "full", is deprecated and warns)
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=traits.qkv_bias,
        qk_layernorm=traits.qk_norm,
        rotary_interleaved=False,  # HF rotate_half
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        context_parallel_size=parallel.context,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        variable_seq_lengths=True,  # micro-batches differ in length; PP stages exchange shapes first
        moe_token_dispatcher_type="alltoall",  # unused (dense); "allgather" refuses variable_seq_lengths
        use_cpu_initialization=cpu,
        # Every weight is then overwritten from the HF critic, but megatron 0.16.1 only tags sharded
        # weights `tensor_model_parallel` inside its init functions: without them the grad norm
        # counts every sharded weight on tensor rank 0 only (measured: 17% low at TP2).
        perform_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )
