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
from critic_adapters.common.tests.helpers import run_pytest

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

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
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


if __name__ == "__main__":
    run_pytest(__file__)
