"""The critic as a megatron-core GPTModel: decoder layers from the HF config, and in place of the
vocab projection a replicated Linear(H, 1, bias=True) (num_bins outputs for HL-Gauss) on the last pipeline stage (values float32).

Layer spec: TransformerEngine's when TE is importable and CUDA is present (packed rows through
PackedSeqParams/THD), else our local spec: megatron's parallel linears, torch RMSNorm, and
PackedCoreAttention (attention.py) as the core attention.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from .attention import PackedCoreAttention
from .config import FamilyTraits, rope_theta


class CriticRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm built from megatron's norm arguments. Under sequence parallelism its weight sees
    only this rank's part of the sequence, so it is tagged for megatron's tensor-parallel grad
    all-reduce (finalize_model_grads): what TE's norm does, and what megatron's torch norm refuses."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        if config.sequence_parallel:
            for param in self.parameters():
                param.sequence_parallel = True


class ValueHead(torch.nn.Module):
    """Replicated hidden -> `outputs` linear computed in fp32 (1 for a scalar critic, num_bins for
    HL-Gauss: the engine turns bin logits into values); under sequence parallelism it runs on this
    rank's part of the sequence and the outputs are gathered (each rank then holds the whole
    [s, b, outputs]). Its tensors are `output_layer.weight` [outputs, H] and `output_layer.bias`
    [outputs]: the names GPTModel's sharded_state_dict (dist_checkpointing) expects of an output layer.

    Its parameters have the model's dtype (`dtype`, bf16 under engine.mixed_precision=bf16; the
    optimizer keeps fp32 main copies of them): megatron-core 0.16.1's optimizers assume one dtype
    per parameter group, and an fp32 parameter among bf16 ones gets another's state in their
    checkpoints (DistributedOptimizer orders a group's shards fp32 first, its checkpoint index does
    not; Float16OptimizerWithFloat16Params maps only the 16-bit ones)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, outputs: int = 1,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(outputs, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(outputs, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            for param in self.parameters():
                param.sequence_parallel = True

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        values = F.linear(hidden.float(), self.weight.float(), self.bias.float())  # (s, b, outputs)
        if self.sequence_parallel:
            # The loss is computed whole on every tensor-parallel rank, so the gradient of this
            # rank's part is just its slice (no reduce-scatter).
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def local_mlp_spec(traits: FamilyTraits, moe_layer: bool) -> ModuleSpec:
    """The layer's MLP: SwiGLU, or megatron-core's MoE layer (router, the token dispatcher, experts
    run one after another by SequentialMLP, the shared expert with its gate)."""
    if not moe_layer:
        return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                               linear_fc2=RowParallelLinear))
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(use_te=False, num_experts=traits.moe.experts, moe_grouped_gemm=False)


def local_layer_spec(traits: FamilyTraits, moe_layer: bool = False) -> ModuleSpec:
    qk_norm = CriticRMSNorm if traits.qk_norm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=CriticRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=PackedCoreAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=CriticRMSNorm,
            mlp=local_mlp_spec(traits, moe_layer),
            mlp_bda=get_bias_dropout_add,
            # dist_checkpointing names as in the TE spec, so checkpoints move between the two specs.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def block_spec(tf_config, traits: FamilyTraits, use_te: bool, first_layer: int = 0) -> TransformerBlockSubmodules:
    """This pipeline stage's layers (from HF layer `first_layer` on) plus the final norm."""
    count = get_num_layers_to_build(tf_config)
    moe_layers = traits.moe.moe_layers[first_layer:first_layer + count] if traits.moe else (False,) * count
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        def layer_spec(moe_layer):
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts=traits.moe.experts if moe_layer else None, moe_grouped_gemm=False,
                qk_layernorm=traits.qk_norm)
        norm = TENorm
    else:
        def layer_spec(moe_layer):
            return local_layer_spec(traits, moe_layer)
        norm = CriticRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec(moe_layer) for moe_layer in moe_layers],
                                      layer_norm=norm)


def build_value_model(hf_config, tf_config, traits: FamilyTraits, *, pre_process: bool, post_process: bool,
                      padded_vocab: int, use_te: bool, first_layer: int = 0) -> GPTModel:
    """One pipeline stage of the critic (parallel_state must be initialised)."""
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=block_spec(tf_config, traits, use_te, first_layer),
        vocab_size=padded_vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,  # a critic never ties: it has no vocab projection
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf_config),
    )
    if post_process:
        model.output_layer = ValueHead(tf_config.hidden_size, tf_config.sequence_parallel, outputs=hf_config.num_labels,
                                       dtype=tf_config.params_dtype)
    return model
