"""CPU compatibility for VeOmni 0.1.12: every workaround this backend needs when CUDA is absent.

VeOmni assumes an accelerator in a few places (measured in shared/notes/veomni-feasibility.md).
Everything here is used only when `cpu_mode()` is True; on GPU the engine calls VeOmni plainly.
Nothing here patches VeOmni or torch: each workaround is a choice of arguments or a small piece of
VeOmni's own logic done for it.

  1. Kernels: `OpsImplementationConfig()` defaults to triton / liger / flash-attention and raises on
     a machine without them (on GPU too, when liger-kernel is not installed). `ops_implementation()`
     asks for eager kernels, or liger's where common.parallel.kernels.veomni_ops chooses them.
  2. Process group: VeOmni's `get_dist_comm_backend()` has no gloo branch;
     the engine joins the group common.parallel.distributed made (gloo on CPU) before VeOmni is called, and
     VeOmni never creates one itself on this path.
  3. One process: `build_parallelize_model` refuses every `init_device` but cuda/npu/mlu when FSDP
     is off (fsdp_size == 1), although with FSDP off it uses the flag for nothing else.
     `parallelize_one_rank()` does what VeOmni does there for a critic: non-reentrant gradient
     checkpointing (no dtype change: the weights stay in the dtype they were built in).
  4. Ulysses: VeOmni's sequence-parallel attention is flash-attention / flex-attention /
     magi-attention with all-to-all around it; none of them has a CPU backward. The engine uses
     common/parallel/ulysses.py instead (on every device), under its own attention name, so VeOmni's
     Ulysses code paths are never entered.
"""

from __future__ import annotations

import torch


def cpu_mode() -> bool:
    """True when the workarounds apply: no CUDA."""
    return not torch.cuda.is_available()


# Every kernel choice of OpsImplementationConfig that has a GPU-only default.
_EAGER_KERNELS = ("moe_implementation", "cross_entropy_loss_implementation", "rms_norm_implementation",
                  "swiglu_mlp_implementation", "rotary_pos_emb_implementation",
                  "rotary_pos_emb_vision_implementation", "load_balancing_loss_implementation",
                  "rms_norm_gated_implementation", "causal_conv1d_implementation",
                  "chunk_gated_delta_rule_implementation")


# The kernels liger-kernel provides, when common.parallel.kernels.veomni_ops chooses it (CUDA with
# liger_kernel installed); every other kernel stays eager, as on CPU.
_LIGER_KERNELS = ("rms_norm_implementation", "swiglu_mlp_implementation", "rotary_pos_emb_implementation")


def ops_implementation(attn_implementation: str, fused: str = "eager"):
    """VeOmni's kernel selection: every kernel eager, or (`fused` "liger", the kernel policy's
    veomni_ops) liger-kernel's RMSNorm, SwiGLU and rotary. Never VeOmni's own defaults: they name
    liger / triton / fla kernels that raise when those packages are absent.

    `attn_implementation` is set after construction: VeOmni's __post_init__ validates only its own
    names, and ours (critic_packed_attention) is registered with transformers' AttentionInterface.
    """
    from veomni.arguments.arguments_types import OpsImplementationConfig

    kernels = {name: "eager" for name in _EAGER_KERNELS}
    if fused == "liger":
        kernels.update({name: "liger_kernel" for name in _LIGER_KERNELS})
    ops = OpsImplementationConfig(attn_implementation="sdpa", **kernels)
    ops.attn_implementation = attn_implementation
    return ops


def parallelize_one_rank(model: torch.nn.Module, *, gradient_checkpointing: bool) -> torch.nn.Module:
    """What build_parallelize_model does when FSDP is off (one data-parallel rank), for CPU, where it
    refuses to run (see 3. above): gradient checkpointing, non-reentrant. Mixed precision is
    FSDP2's policy in VeOmni, so with one rank there is none (the engine warns)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
