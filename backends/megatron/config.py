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
from ...common.valuehead.experts import experts_of, moe_layer_flags

# Families whose HF layout maps onto a megatron-core GPTModel with our converter (convert.py):
# RMSNorm, SwiGLU, rotary, GQA; what differs between them is the attention extras and, for the
# MoE families, megatron-core's MoE layer in place of the MLP.
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES


@dataclasses.dataclass(frozen=True, slots=True)
class MoETraits:
    """A mixture-of-experts family's MLP, as megatron-core's MoELayer builds it."""

    experts: int
    top_k: int
    ffn_size: int
    """Each routed expert's intermediate size."""
    normalize_top_k: bool
    """The top-k routing weights renormalised to sum to 1 (mixtral always; qwen when norm_topk_prob):
    megatron's top-k before the softmax; else softmax over every expert, then top-k (pre-softmax)."""
    shared_ffn_size: int | None
    """qwen2_moe's shared expert (its intermediate size), always with a sigmoid gate."""
    moe_layers: tuple[bool, ...]
    """Per HF layer: an MoE layer, or the family's dense MLP (qwen's mlp_only_layers, decoder_sparse_step)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FamilyTraits:
    qkv_bias: bool
    """q/k/v projections carry a bias (qwen2 always; llama/mistral/qwen3 when attention_bias)."""
    qk_norm: bool
    """RMSNorm over each query/key head (qwen3, qwen3_moe)."""
    moe: MoETraits | None = None
    """The experts of a MoE family; None for a dense one."""


def moe_traits(hf_config: PretrainedConfig) -> MoETraits | None:
    """The experts of a mixtral / qwen2_moe / qwen3_moe config (None for other families)."""
    if hf_config.model_type not in MOE_FAMILIES:
        return None
    experts = experts_of(hf_config)
    ffn = hf_config.intermediate_size if hf_config.model_type == "mixtral" else hf_config.moe_intermediate_size
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) if hf_config.model_type == "qwen2_moe" else None
    return MoETraits(experts=experts.routed, top_k=experts.top_k, ffn_size=ffn,
                     normalize_top_k=bool(experts.renormalised), shared_ffn_size=shared or None,
                     moe_layers=moe_layer_flags(hf_config))


def family_traits(hf_config: PretrainedConfig) -> FamilyTraits:
    model_type = hf_config.model_type
    if getattr(hf_config, "vision_config", None) is not None:
        raise ValueError(
            f"the megatron backend has no vision-language critic ({model_type}): megatron-core's GPT model has "
            f"no vision tower or multimodal rope. Train it with backend=fsdp or backend=veomni, whose libraries "
            f"model {model_type} (transformers' and VeOmni's modeling)")
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"the megatron backend does not support model_type={model_type!r}; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)} (use backend=fsdp for other families)")
    qkv_bias = model_type in ("qwen2", "qwen2_moe") or bool(getattr(hf_config, "attention_bias", False))
    return FamilyTraits(qkv_bias=qkv_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"), moe=moe_traits(hf_config))


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
    if (traits.moe is None or not all(traits.moe.moe_layers)) and hf_config.intermediate_size % tp:
        raise ValueError(f"engine.parallel.tensor={tp} must divide intermediate_size={hf_config.intermediate_size}")
    check_moe_layout(hf_config, traits.moe, parallel, world_size)
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


def check_moe_layout(hf_config: PretrainedConfig, moe: MoETraits | None, parallel: ParallelConfig,
                     world_size: int) -> None:
    """Expert parallelism and the router settings this backend reproduces exactly."""
    ep, tp = parallel.expert, parallel.tensor
    if moe is None:
        if ep != 1:
            raise ValueError(f"engine.parallel.expert={ep}: {hf_config.model_type} has no experts (a dense model); "
                             f"set engine.parallel.expert=1")
        return
    if moe.experts % ep:
        raise ValueError(f"engine.parallel.expert={ep} must divide the {moe.experts} experts of "
                         f"{hf_config.model_type}; pick a divisor of {moe.experts}")
    # Experts are split over the data x context ranks of a pipeline stage (megatron's expert grid
    # tensor-expert-data-pipeline, with the experts' tensor parallelism that of the dense layers).
    model_parallel = tp * parallel.pipeline * parallel.context
    if world_size % model_parallel == 0 and (world_size // model_parallel * parallel.context) % ep:
        raise ValueError(f"engine.parallel.expert={ep} must divide the data x context parallel degree "
                         f"({world_size // model_parallel * parallel.context} of {world_size} processes): experts "
                         f"are spread over the data-parallel ranks; launch a multiple of {model_parallel * ep} "
                         f"processes or lower engine.parallel.expert")
    if tp > 1 and not parallel.sequence_parallel:
        raise ValueError(f"engine.parallel.tensor={tp} on the mixture-of-experts {hf_config.model_type} needs "
                         f"engine.parallel.sequence_parallel=true (megatron-core's MoE layer trains tensor-parallel "
                         f"only with the sequence split over the tensor ranks); set sequence_parallel: true")
    for name, size in (("moe_intermediate_size", moe.ffn_size), ("shared_expert_intermediate_size",
                                                                  moe.shared_ffn_size or 0)):
        if size % tp:
            raise ValueError(f"engine.parallel.tensor={tp} must divide {name}={size} (the experts are split over "
                             f"the tensor-parallel ranks too)")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise={hf_config.router_jitter_noise}: the megatron backend routes "
                         f"without input jitter; set it to 0 in config.json or use backend=fsdp")


def check_layout(hf_config: PretrainedConfig, config: EngineConfig, world_size: int) -> FamilyTraits:
    """The BackendSpec hook (common/engine/registry.py): everything the megatron backend refuses for
    this model and layout, from the config alone. The launcher, the dry run and the trainer call it
    before any process starts or anything is written, and the engine calls it first thing when it
    is built: one list of refusals. Returns the family's traits."""
    traits = check_megatron_config(hf_config, config.parallel, world_size)
    check_megatron_transforms(config.transforms)
    if config.lora.rank:
        check_megatron_targets(config.lora.target_modules)
        check_megatron_lora(traits, hf_config)
    router_aux_experts(hf_config, config)
    return traits


def router_aux_experts(hf_config: PretrainedConfig, config: EngineConfig):
    """engine.loss.router_aux_coef's experts (common.engine.router_aux), or None when it is off;
    refused with pipeline or context parallelism."""
    from ...common.engine import router_aux

    refuse = None
    if config.parallel.pipeline > 1 or config.parallel.context > 1:
        refuse = ("takes engine.parallel.pipeline=1 and context=1 on the megatron backend (transformers' loss "
                  "couples every MoE layer's routing of a whole forward pass)")
    return router_aux.aux_experts(config.loss.router_aux_coef, hf_config, refuse=refuse)


def check_megatron_lora(traits: FamilyTraits, hf_config: PretrainedConfig) -> None:
    """LoRA on megatron adapts the dense linears (lora.py); megatron-core's experts take no adapter here."""
    if traits.moe is not None:
        raise ValueError(f"engine.lora on {hf_config.model_type}: the megatron backend has no LoRA for mixture-of-"
                         f"experts critics (its adapters wrap the dense linears, not megatron-core's experts); use "
                         f"backend=fsdp, whose LoRA adapts the attention (and qwen2_moe's shared expert)")


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


def moe_arguments(moe: MoETraits | None, parallel: ParallelConfig) -> dict:
    """TransformerConfig's MoE fields: HF's routing (softmax router, top-k, renormalised or not),
    per-expert SwiGLU MLPs run one after another (no grouped GEMM kernels: CPU and GPU alike), no
    token dropping, no load-balancing loss (a critic trains on the value loss alone)."""
    if moe is None:
        return {}
    freq = [int(is_moe) for is_moe in moe.moe_layers]
    return dict(
        num_moe_experts=moe.experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_size,
        moe_router_pre_softmax=not moe.normalize_top_k,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=moe.shared_ffn_size,
        moe_shared_expert_gate=moe.shared_ffn_size is not None,
        moe_layer_freq=freq if not all(freq) else 1,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.tensor,
    )


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
        # "allgather" refuses variable_seq_lengths; the all-to-all runs on gloo (CPU) and NCCL alike.
        moe_token_dispatcher_type="alltoall",
        **moe_arguments(traits.moe, parallel),
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
