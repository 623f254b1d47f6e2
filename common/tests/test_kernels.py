"""The kernel policy (common.parallel.kernels), as a table: which attention, megatron layer spec and
VeOmni ops each (device, dtype, packing, installed) gets, and torch's varlen attention wired as
packed attention expects (checked on CPU with a reference kernel in its place: the real one is
CUDA-only, run by tools/gpu-check)."""

import pytest
import torch
import torch.nn.functional as F

from critic_adapters.common.parallel import kernels, packed_attention, varlen_attention
from critic_adapters.common.tests.helpers import run_pytest

BF16, FP32 = torch.bfloat16, torch.float32


def have(*names: str) -> kernels.Installed:
    fields = dict.fromkeys(("cuda", "flash_attn", "torch_varlen", "transformer_engine", "liger_kernel"), False)
    return kernels.Installed(**{**fields, **dict.fromkeys(names, True)})


GPU = have("cuda")
GPU_FLASH = have("cuda", "flash_attn", "torch_varlen")
GPU_TE = have("cuda", "transformer_engine")


@pytest.mark.parametrize("dtype, packed, installed, expected", [
    (FP32, True, GPU_FLASH, kernels.PACKED_SDPA),        # item 1: no flash in fp32
    (FP32, False, GPU_FLASH, "sdpa"),                    # item 1
    (BF16, True, GPU_FLASH, "flash_attention_2"),
    (BF16, False, GPU_FLASH, "flash_attention_2"),
    (BF16, True, have("cuda", "torch_varlen"), kernels.TORCH_VARLEN),  # item 12
    (BF16, True, GPU, kernels.PACKED_SDPA),
    (BF16, True, have(), kernels.PACKED_SDPA),           # CPU
    (FP32, False, have(), "sdpa"),
])
def test_attention_table(dtype, packed, installed, expected):
    """Issue 41, items 1, 12 and 13: one rule for every path (load_critic, the FSDP2 engines)."""
    assert kernels.attention(compute_dtype=dtype, packed=packed, have=installed).kernel == expected


def test_attention_follows_what_the_model_class_takes():
    assert kernels.attention(compute_dtype=BF16, packed=False, have=GPU_FLASH, flash_capable=False).kernel == "sdpa"
    assert kernels.attention(compute_dtype=FP32, packed=False, have=GPU, sdpa_capable=False).kernel == "eager"
    assert kernels.attention(compute_dtype=BF16, packed=True, have=have("cuda", "torch_varlen"),
                             softcap=True).kernel == kernels.PACKED_SDPA


@pytest.mark.parametrize("dtype, packed, context, installed, expected", [
    (FP32, True, 1, GPU_TE, "local"),   # item 2: TE has no fp32 backend for packed (THD) rows
    (BF16, False, 1, GPU_TE, "local"),  # item 3: TE's causal mask type would ignore the padding
    (BF16, True, 2, GPU_TE, "local"),   # this engine's context parallelism is the local spec's
    (BF16, True, 1, GPU_TE, "te"),
    (BF16, True, 1, GPU, "local"),
    (BF16, True, 1, have(), "local"),
])
def test_megatron_layer_spec_table(dtype, packed, context, installed, expected):
    """Issue 41, items 2 and 3: the TransformerEngine spec only where TE runs it correctly."""
    choice = kernels.megatron_spec(compute_dtype=dtype, packed=packed, context=context, have=installed)
    assert choice.kernel == expected, choice


def test_veomni_ops_table():
    """Issue 41, item 5: VeOmni's GPU defaults need liger-kernel: eager unless it is installed."""
    assert kernels.veomni_ops(have=GPU).kernel == "eager"
    assert kernels.veomni_ops(have=have("cuda", "liger_kernel")).kernel == "liger"
    assert kernels.veomni_ops(have=have()).kernel == "eager"


def test_installed_needs_cuda_for_every_cuda_kernel(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.installed() == have()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    found = kernels.installed()
    assert found.flash_attn and found.transformer_engine and found.liger_kernel


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                     **unused):
    """varlen_attn's contract, per its docstring, on CPU: (T, H, D) tokens, sequences at cu bounds,
    window_size (left, right) keeps keys j in [i - left, i + right] (-1: unbounded)."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    bounds = cu_q.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_q
    out = []
    for start, end in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        i = torch.arange(end - start)
        distance = i[:, None] - i[None, :]
        keep = (distance >= -window_size[1] if window_size[1] >= 0 else True) & (
            distance <= window_size[0] if window_size[0] >= 0 else True)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, scale=scale,
                                                  enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 3])
def test_torch_varlen_attention_equals_packed_attention(monkeypatch, window):
    """Issue 41, item 12: the cumulative bounds, layouts, GQA and window passed to varlen_attn give
    packed attention's result (a reference kernel on CPU in varlen_attn's place)."""
    monkeypatch.setattr(varlen_attention, "_kernel", lambda: reference_varlen)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    spans = [[(0, 4), (4, 11)], [(0, 6), (6, 9), (9, 11)]]
    module = torch.nn.Module().eval()
    with packed_attention.stated_bounds(spans):
        got, _ = varlen_attention.varlen_attention(module, q, k, v, None, scaling=0.3, sliding_window=window)
        expected, _ = packed_attention.packed_attention(module, q, k, v, None, scaling=0.3, sliding_window=window)
    torch.testing.assert_close(got, expected)
    bounds, longest = varlen_attention.cumulative_bounds(spans, 11, "cpu")
    assert bounds.tolist() == [0, 4, 11, 17, 20, 22] and longest == 7


if __name__ == "__main__":
    run_pytest(__file__)
