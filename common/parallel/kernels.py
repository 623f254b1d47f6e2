"""The kernel policy: which attention and which fused kernels a critic runs, decided in one place.

  (device, compute dtype, packed rows, what is installed) -> attention, megatron layer spec, VeOmni ops

Every path that picks a kernel asks here (load_critic, the FSDP2 engines, megatron's layer spec,
VeOmni's ops) and reports the answer with its reason (LoadReport.kernels). The rules, each from a
kernel's own limits:
- flash-attention (flash_attn) and torch's varlen attention (torch.nn.attention.varlen, the same
  FA2 kernel) run only on CUDA and only in fp16/bf16: an fp32 critic (the default) never gets them
  (it once crashed at the first forward on any GPU machine with flash_attn installed).
- packed rows: flash_attn's varlen kernel > torch's varlen kernel > our per-sequence sdpa
  (critic_packed_attention, every device and dtype); padded rows: flash_attention_2 > sdpa > eager,
  as the model class allows.
- megatron's TransformerEngine spec: CUDA, TE installed, bf16/fp16, packed rows (TE's THD input has
  no fp32 backend, and its causal mask type ignores padding) and no context parallelism (this
  engine's CP layout is the local spec's); otherwise the local spec.
- VeOmni's fused kernels (liger-kernel RMSNorm / SwiGLU / rotary): CUDA with liger_kernel
  importable; otherwise eager (VeOmni's GPU defaults raise without liger).
- grouped K/V heads: sdpa broadcasts them itself only where a fused kernel takes that (CUDA: flash,
  bf16/fp16, no mask); elsewhere on CUDA common.parallel.sdpa repeats them (sdpa_broadcasts_kv).
`Installed` is the seam: tests state what is installed instead of probing the machine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect

import torch

HALF = (torch.float16, torch.bfloat16)
PACKED_SDPA = "critic_packed_attention"  # common.parallel.packed_attention.ATTENTION_NAME
TORCH_VARLEN = "critic_varlen_attention"  # common.parallel.varlen_attention.ATTENTION_NAME


@dataclasses.dataclass(frozen=True, slots=True)
class Installed:
    """What this machine can run."""

    cuda: bool
    flash_attn: bool
    """flash_attn imports (it has CUDA kernels only)."""
    torch_varlen: bool
    """torch.nn.attention.varlen.varlen_attn exists, with the window_size argument (torch >= 2.10)."""
    transformer_engine: bool
    liger_kernel: bool


@functools.cache
def _torch_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "window_size" in inspect.signature(varlen_attn).parameters


def installed() -> Installed:
    """Probe this machine (imports nothing heavy: find_spec only)."""
    cuda = torch.cuda.is_available()
    found = {name: importlib.util.find_spec(name) is not None
             for name in ("flash_attn", "transformer_engine", "liger_kernel")}
    return Installed(cuda=cuda, flash_attn=cuda and found["flash_attn"], torch_varlen=cuda and _torch_varlen(),
                     transformer_engine=cuda and found["transformer_engine"], liger_kernel=cuda and found["liger_kernel"])


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    kernel: str
    why: str

    def __str__(self) -> str:
        return f"{self.kernel} ({self.why})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention(*, compute_dtype: torch.dtype, packed: bool, have: Installed, flash_capable: bool = True,
              sdpa_capable: bool = True, softcap: bool = False) -> Choice:
    """The attention for rows computed in `compute_dtype`: packed (several sequences per row,
    position ids restarting) or padded; `flash_capable` / `sdpa_capable`: what the model class
    supports; `softcap`: the family soft-caps attention logits (gemma2), which varlen_attn cannot."""
    half = compute_dtype in HALF
    where = f"{'CUDA' if have.cuda else 'no CUDA'}, {_dtype_name(compute_dtype)}"
    if packed:
        if half and have.flash_attn and flash_capable:
            return Choice("flash_attention_2", f"packed rows, {where}: flash_attn's varlen kernel")
        if half and have.torch_varlen and not softcap:
            return Choice(TORCH_VARLEN, f"packed rows, {where}: torch's varlen flash kernel (flash_attn not installed)")
        reason = "flash kernels need CUDA and bf16/fp16" if not (have.cuda and half) else "no varlen kernel for this family"
        return Choice(PACKED_SDPA, f"packed rows, {where}: sdpa per sequence ({reason})")
    if half and have.flash_attn and flash_capable:
        return Choice("flash_attention_2", f"padded rows, {where}")
    if sdpa_capable:
        why = "" if half and have.cuda else ": flash-attention needs CUDA and bf16/fp16"
        return Choice("sdpa", f"padded rows, {where}{why}")
    return Choice("eager", f"padded rows, {where}: the model class takes neither flash-attention nor sdpa")


def check_explicit_attention(name: str, compute_dtype: torch.dtype, key: str = "engine.model.attn_implementation") -> None:
    """ValueError for an explicitly asked flash kernel that cannot run in `compute_dtype`."""
    if name.startswith("flash_attention") and compute_dtype not in HALF:
        raise ValueError(f"{key}={name} computes in bf16/fp16 only, and this critic computes in "
                         f"{_dtype_name(compute_dtype)}: use engine.model.dtype=bfloat16 (or engine.mixed_precision=bf16 "
                         f"where the backend honours it), or leave {key} unset")


def sdpa_broadcasts_kv(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether sdpa may broadcast grouped K/V heads itself (enable_gqa) and still get a fused kernel:
    on CUDA only its flash backend takes enable_gqa, in bf16/fp16 without a mask (otherwise MATH,
    the whole score matrix: common.parallel.sdpa repeats K/V instead); CPU's flash kernel takes it
    in every dtype, masked or not."""
    if device_type == "cuda":
        return dtype in HALF and not masked
    return True


def megatron_spec(*, compute_dtype: torch.dtype, packed: bool, context: int, have: Installed) -> Choice:
    """'te' (TransformerEngine's layer spec) or 'local' (megatron's own modules, our attention)."""
    if not have.transformer_engine:
        return Choice("local", "TransformerEngine is not installed" if have.cuda else "no CUDA")
    if compute_dtype not in HALF:
        return Choice("local", f"{_dtype_name(compute_dtype)}: TransformerEngine's attention has no fp32 backend "
                               f"for packed (THD) rows")
    if not packed:
        return Choice("local", "padded rows: TransformerEngine's causal mask type would ignore the padding")
    if context > 1:
        return Choice("local", "context parallelism runs on the local spec's layout")
    return Choice("te", f"CUDA, {_dtype_name(compute_dtype)}, packed rows")


def veomni_ops(*, have: Installed) -> Choice:
    """'liger' (liger-kernel RMSNorm, SwiGLU and rotary; the rest eager) or 'eager'."""
    if have.liger_kernel:
        return Choice("liger", "CUDA with liger_kernel installed: its RMSNorm, SwiGLU and rotary kernels")
    return Choice("eager", "liger_kernel is not installed" if have.cuda else "no CUDA")
