"""PackedCoreAttention: packed (THD) rows attend within each sequence only, with sdpa per sequence
span and never an N x N mask over the row; padded rows follow the boolean mask."""

import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from critic_adapters.backends.megatron import attention, context_parallel
from critic_adapters.backends.megatron.attention import PackedCoreAttention
from critic_adapters.common.tests.helpers import assert_fused_kernel_calls, run_pytest, sdpa_calls_as_on_cuda

HEADS, GROUPS, D = 4, 2, 8


def core() -> PackedCoreAttention:
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=D, use_cpu_initialization=True)
    return PackedCoreAttention(config, layer_number=1, attn_mask_type=None, attention_type="self").eval()


def eager_causal(q, k, v):
    """q (L, h, d), k/v (L, g, d) -> (L, h * d): plain softmax attention of one sequence."""
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1)


def test_packed_rows_attend_per_sequence_without_a_dense_mask(monkeypatch):
    lengths = [5, 3, 5, 1]
    total = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, n, D, generator=g) for n in (HEADS, GROUPS, GROUPS))
    cu = torch.tensor([0, 5, 8, 13, 14], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append((tuple(query.shape), kwargs.get("attn_mask") is not None))
        return real_sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = core()(q, k, v, None, packed_seq_params=params)
    expected = torch.cat([eager_causal(q[s:e], k[s:e], v[s:e]) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert out.shape == (total, HEADS * D)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # One batched call per distinct length, each over a span, never over the packed row, never masked.
    assert sorted(calls) == sorted([((2, HEADS, 5, D), False), ((1, HEADS, 3, D), False), ((1, HEADS, 1, D), False)])
    # Negative control: one causal pass over the whole row lets sequences see each other.
    whole = eager_causal(q, k, v)
    assert float((whole - expected).abs().max()) > 1e-2


def test_padded_rows_follow_the_mask():
    s, b = 6, 2
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, b, n, D, generator=g) for n in (HEADS, GROUPS, GROUPS))
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    out = core()(q, k, v, ~allowed)  # (s, b, h * d)
    for row in range(b):
        n = int(valid[row].sum())
        expected = eager_causal(q[:n, row], k[:n, row], v[:n, row])
        torch.testing.assert_close(out[:n, row], expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("cp_size", [2, 3])
def test_a_cp_ranks_chunks_attend_like_the_masked_whole_with_their_gradients(cp_size):
    """context_parallel.chunk_attention (two flash calls per chunk joined by log-sum-exp, a custom
    backward) equals sdpa under the causal mask of the chunks' global positions: values and the
    gradients of q, k and v, in float64, on every rank's layout."""
    span = 2 * cp_size * 5
    for rank in range(cp_size):
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(2, HEADS, span // cp_size, D, dtype=torch.float64, generator=g, requires_grad=True)
        k, v = (torch.randn(2, HEADS, span, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in "kv")
        mine = context_parallel.chunk_positions(span, cp_size, rank)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mine[:, None] >= torch.arange(span)[None])
        grad = torch.randn(expected.shape, dtype=torch.float64, generator=g)
        want = torch.autograd.grad(expected, (q, k, v), grad)
        actual = context_parallel.chunk_attention(q, k, v, cp_size, rank, scale=D ** -0.5)
        got = torch.autograd.grad(actual, (q, k, v), grad)
        assert torch.allclose(actual, expected, rtol=0, atol=1e-12)
        for name, a, b in zip("qkv", got, want):
            assert torch.allclose(a, b, rtol=0, atol=1e-10), f"d{name} of rank {rank} differs by {float((a - b).abs().max())}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_heads_reach_a_fused_cuda_kernel(monkeypatch, dtype):
    """issue 41, item 8: on CUDA only flash takes enable_gqa (bf16/fp16, no mask): packed rows in
    fp32 and every padded (masked) call arrive with repeated K/V heads; bf16 packed rows keep them
    grouped. The values are today's CPU ones."""
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 5, 8, 13], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    packed = [torch.randn(13, n, D, generator=g).to(dtype) for n in (HEADS, GROUPS, GROUPS)]
    padded = [torch.randn(6, 2, n, D, generator=g).to(dtype) for n in (HEADS, GROUPS, GROUPS)]
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & torch.tensor([[1] * 6, [1] * 4 + [0] * 2],
                                                                                   dtype=torch.bool)[:, None, None, :]
    attention_core = core()

    def attend():
        return attention_core(*packed, None, packed_seq_params=params), attention_core(*padded, ~allowed)

    today = attend()
    calls = sdpa_calls_as_on_cuda(monkeypatch)
    torch.testing.assert_close(attend(), today)
    assert_fused_kernel_calls(calls)
    assert any(call["enable_gqa"] for call in calls) == (dtype == torch.bfloat16)


def test_each_device_and_dtype_gets_an_attention_kernel_that_returns_its_log_sum_exp():
    """issue 41, item 9: which kernel runs a CP rank's chunks without a mask, as a table: CPU's flash
    kernel (any dtype); on CUDA, flash for bf16/fp16 and the memory-efficient kernel for fp32; none
    (a masked call) elsewhere."""
    cp = context_parallel
    table = {(device, dtype): cp.lse_kernel(device, dtype) for device in ("cpu", "cuda", "mps")
             for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}
    assert table == {
        ("cpu", torch.float64): cp.CPU_FLASH, ("cpu", torch.float32): cp.CPU_FLASH,
        ("cpu", torch.bfloat16): cp.CPU_FLASH, ("cpu", torch.float16): cp.CPU_FLASH,
        ("cuda", torch.float64): None, ("cuda", torch.float32): cp.CUDA_EFFICIENT,
        ("cuda", torch.bfloat16): cp.CUDA_FLASH, ("cuda", torch.float16): cp.CUDA_FLASH,
        ("mps", torch.float64): None, ("mps", torch.float32): None, ("mps", torch.bfloat16): None,
        ("mps", torch.float16): None}


def test_the_cpu_log_sum_exp_kernel_matches_the_reference():
    """issue 41, item 9: the CPU kernel's output and log-sum-exp, causal and not, against plain softmax
    attention (float64)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, HEADS, 6, D, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, HEADS, 6, D, dtype=torch.float64, generator=g) for _ in "kv")
    for causal in (False, True):
        out, lse, _ = context_parallel.CPU_FLASH.forward(q, k, v, causal, 0.3)
        scores = q @ k.transpose(-1, -2) * 0.3
        if causal:
            scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
        torch.testing.assert_close(out, scores.softmax(-1) @ v)


@pytest.mark.parametrize("kernel,dtype", [("CUDA_FLASH", torch.bfloat16), ("CUDA_EFFICIENT", torch.float32)])
def test_the_cuda_log_sum_exp_kernels_call_their_ops_as_the_schemas_say(kernel, dtype):
    """issue 41, item 9: the CUDA kernels' forward and backward, run on meta tensors (torch's meta
    kernels of the same aten ops): arguments and shapes line up; the log-sum-exp is (S, h, Lq)
    (the memory-efficient op pads it to a multiple of 32, and gets it padded back)."""
    kernel = getattr(context_parallel, kernel)
    q = torch.empty(2, HEADS, 10, D, dtype=dtype, device="meta")
    k, v = (torch.empty(2, HEADS, 30, D, dtype=dtype, device="meta") for _ in "kv")
    out, lse, aux = kernel.forward(q, k, v, False, 0.3)
    assert out.shape == q.shape and lse.shape == (2, HEADS, 10) and lse.dtype == torch.float32
    grads = kernel.backward(out, q, k, v, out, lse, aux, False, 0.3)
    assert [tuple(t.shape) for t in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_context_parallel_builds_no_dense_mask(monkeypatch, dtype):
    """issue 41, item 9: with the kernel device set to "cuda", a CP rank's packed chunks attend
    through the CUDA log-sum-exp kernel of their dtype (run here by the CPU kernel in its place) and
    never build the (L/N x L) mask; values and gradients equal the masked reference. fp64, which
    no CUDA kernel takes, still masks (the control: the patched mask builder is the one used)."""
    cp = context_parallel
    used = []

    def in_place_of(kernel):
        def forward(*args):
            used.append(kernel.name)
            return cp.CPU_FLASH.forward(*args)
        return cp.LseKernel(kernel.name, forward, cp.CPU_FLASH.backward)

    for key, kernel in list(cp.LSE_KERNELS.items()):
        if key[0] == "cuda":
            monkeypatch.setitem(cp.LSE_KERNELS, key, in_place_of(kernel))

    def no_dense_mask(*args):
        raise AssertionError("the dense (L/N x L) mask was built")

    monkeypatch.setattr(cp, "chunk_mask", no_dense_mask)
    monkeypatch.setattr("critic_adapters.common.parallel.sdpa.kernel_device", lambda t: "cuda")
    cp_size, span, rank = 2, 20, 1
    monkeypatch.setattr(attention, "group_rank", lambda group: rank)
    attention_core = core()
    attention_core.cp_size = cp_size
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, HEADS, span // cp_size, D, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, GROUPS, span, D, generator=g).to(dtype).requires_grad_() for _ in "kv")
    grad = torch.randn(q.shape, generator=g).to(dtype)
    out = attention_core._chunks(q, k, v, span)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert set(used) == {"cuda flash" if dtype == torch.bfloat16 else "cuda memory-efficient"}
    mine = cp.chunk_positions(span, cp_size, rank)
    keep = mine[:, None] >= torch.arange(span)[None]
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*wide, attn_mask=keep, scale=D ** -0.5, enable_gqa=True)
    want = torch.autograd.grad(expected, wide, grad.double())
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out.double(), expected, **tolerance)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **tolerance)
    with pytest.raises(AssertionError, match="dense"):
        attention_core._chunks(q.double(), k.double(), v.double(), span)


if __name__ == "__main__":
    run_pytest(__file__)
