"""Token-budget micro-batching, packing round trips, and the per-sequence packed attention."""

import pytest
import torch
import torch.nn.functional as F

from critic_adapters.common.parallel import packed_attention, ulysses
from critic_adapters.common.parallel.batching import (data_parallel_shares, make_micro_batches, plan_fixed_size,
                                                     plan_token_budget)
from critic_adapters.common.tests.helpers import assert_fused_kernel_calls, run_pytest, sdpa_calls_as_on_cuda


def test_token_budget_balances_by_tokens_not_rows():
    lengths = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 90]
    plan = plan_token_budget(lengths, budget=110)
    loads = sorted(sum(lengths[i] for i in mb) for mb in plan)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert max(loads) <= 110 and max(loads) - min(loads) <= 10, loads
    # Row-count batching of the same data would put 100 + 90 tokens together.
    assert any(sum(lengths[i] for i in mb) > 110 for mb in plan_fixed_size(len(lengths), 6))


def _mask(lengths, width=None):
    width = width or max(lengths)
    return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()


def test_data_parallel_shares_balance_tokens_deterministically():
    # 10% of the rollouts 8x longer, every one of them at a rank-0 position of r::n.
    lengths = [400 if i % 10 == 0 else 50 for i in range(40)]
    mask = _mask(lengths)
    shares = data_parallel_shares(mask, 2)
    assert sorted(torch.cat(shares).tolist()) == list(range(40))  # a partition of the rows
    assert all(torch.equal(share, share.sort().values) for share in shares)
    balanced = [int(mask[share].sum()) for share in shares]
    strided = [int(mask[r::2].sum()) for r in range(2)]
    assert strided == [2400, 1000] and balanced == [1700, 1700], (strided, balanced)
    assert [s.tolist() for s in data_parallel_shares(mask, 2)] == [s.tolist() for s in shares]  # deterministic
    # The Ray tests' mini-batch: lengths 12, 7, 10, 5, 9 -> {12, 7, 5} and {10, 9}.
    assert [s.tolist() for s in data_parallel_shares(_mask([12, 7, 10, 5, 9]), 2)] == [[0, 1, 3], [2, 4]]
    assert [s.tolist() for s in data_parallel_shares(_mask([5]), 2)] == [[0], []]  # fewer rows than ranks


def test_data_parallel_shares_count_a_vision_critics_image_patches():
    """Four rows of equal length, rows 0 and 2 with an image of 64 patches: by tokens alone both
    image rows land on one rank; counting the patches (what the vision tower encodes) splits them."""
    from critic_adapters.common.testdata import tiny_config
    from critic_adapters.common.testdata.vision import vision_batch
    from critic_adapters.common.valuehead.multimodal import as_rows, vision_patches

    _, _, images = vision_batch(tiny_config("qwen2_vl"), [[(1, 8, 8)], [], [(1, 8, 8)], []], seed=0)
    mask = _mask([20, 20, 20, 20])
    patches = vision_patches(as_rows(images, 4), 4)
    assert patches == [64, 0, 64, 0]
    assert [s.tolist() for s in data_parallel_shares(mask, 2)] == [[0, 2], [1, 3]]
    assert [s.tolist() for s in data_parallel_shares(mask, 2, extra_tokens=patches)] == [[0, 1], [2, 3]]


def test_compute_values_has_its_own_micro_batch_budget():
    from critic_adapters.common.engine.config import BatchingConfig
    from critic_adapters.common.engine.update_step import step_micro_batches

    mask = _mask([30] * 8)
    ids = torch.ones_like(mask)
    batching = BatchingConfig(micro_batch_tokens=60, forward_micro_batch_tokens=240)
    assert len(step_micro_batches(ids, mask, batching, group=None)) == 4
    assert len(step_micro_batches(ids, mask, batching, group=None, forward_only=True)) == 1
    same = BatchingConfig(micro_batch_tokens=60)  # unset: the update's budget
    assert len(step_micro_batches(ids, mask, same, group=None, forward_only=True)) == 4
    with pytest.raises(ValueError, match="engine.batching.forward_micro_batch_tokens=0 must be >= 1"):
        BatchingConfig(forward_micro_batch_tokens=0)


def test_a_budget_below_the_longest_row_warns_naming_key_row_and_a_value_that_fits(monkeypatch):
    import warnings

    from critic_adapters.common.engine import update_step
    from critic_adapters.common.engine.config import BatchingConfig

    monkeypatch.setattr(update_step, "_WARNED_LONGEST", {})
    mask = _mask([300, 40, 20])
    ids = torch.ones_like(mask)
    batching = BatchingConfig(micro_batch_tokens=100, forward_micro_batch_tokens=200)
    with pytest.warns(UserWarning, match=r"engine\.batching\.micro_batch_tokens=100 is below the longest row's 300 "
                                         r"tokens.*set engine\.batching\.micro_batch_tokens=512 \(>= 300\)"):
        plan = update_step.step_micro_batches(ids, mask, batching, group=None)
    assert [mb.rows for mb in plan] == [[0], [1, 2]]  # still planned: the long row alone
    with pytest.warns(UserWarning, match=r"engine\.batching\.forward_micro_batch_tokens=200 is below the longest "
                                         r"row's 300 tokens.*forward_micro_batch_tokens=512"):
        update_step.step_micro_batches(ids, mask, batching, group=None, forward_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update_step.step_micro_batches(ids, mask, batching, group=None)  # said once per key and budget ...
        with pytest.warns(UserWarning, match="longest row's 400 tokens"):  # ... unless a longer row comes
            longer = _mask([400, 40])
            update_step.step_micro_batches(torch.ones_like(longer), longer, batching, group=None)
        # No warning when the budget fits the longest row, or with a fixed micro_batch_size (no budget).
        update_step.step_micro_batches(ids, mask, BatchingConfig(micro_batch_tokens=300), group=None)
        update_step.step_micro_batches(ids, mask, BatchingConfig(micro_batch_tokens=8, micro_batch_size=2),
                                       group=None)
        update_step.whole_micro_batch(ids, mask, BatchingConfig(micro_batch_tokens=8), group=None)


def test_budget_edge_cases():
    assert plan_token_budget([500], budget=100) == [[0]]  # too long: alone, never dropped
    assert plan_token_budget([], budget=100) == [[]]
    plan = plan_token_budget([5, 5], budget=100, min_micro_batches=4)  # another rank needs 4
    assert len(plan) == 4 and sorted(sum(plan, [])) == [0, 1]


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("left_padding", [True, False])
def test_micro_batches_round_trip_every_token(packing, left_padding):
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 12, 1, 9]
    T = 12
    ids = torch.randint(1, 100, (5, T), generator=g)
    mask = torch.zeros(5, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left_padding:
            mask[i, T - n:] = 1
        else:
            mask[i, :n] = 1
    out = torch.zeros(5, T)
    for mb in make_micro_batches(ids, mask, packing=packing, token_budget=16):
        if packing:
            assert mb.input_ids.shape[0] == 1 and mb.attention_mask is None
            assert mb.input_ids.shape[1] == sum(lengths[r] for r in mb.rows) <= 16 or len(mb.rows) == 1
            # positions restart at 0 for each sequence
            assert int((mb.position_ids == 0).sum()) == len(mb.rows)
        out[mb.rows] = mb.unpack(mb.input_ids.float(), T)
    assert torch.equal(out, (ids * mask).float())


def _reference_attention(q, k, v, lengths, scale):
    outs, start = [], 0
    for n in lengths:
        outs.append(F.scaled_dot_product_attention(q[:, :, start:start + n], k[:, :, start:start + n],
                                                   v[:, :, start:start + n], is_causal=True, scale=scale,
                                                   enable_gqa=True))
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_equals_attention_per_sequence(kv_heads):
    g = torch.Generator().manual_seed(1)
    lengths = [5, 8, 5, 1, 8]
    n = sum(lengths)
    q = torch.randn(1, 4, n, 16, generator=g)
    k = torch.randn(1, kv_heads, n, 16, generator=g)
    v = torch.randn(1, kv_heads, n, 16, generator=g)
    position_ids = torch.cat([torch.arange(m) for m in lengths])[None]
    module = torch.nn.Module()
    out, _ = packed_attention.packed_attention(module, q, k, v, None, scaling=0.25, position_ids=position_ids)
    expected = _reference_attention(q, k, v, lengths, 0.25)
    assert out.shape == (1, n, 4, 16)
    assert torch.allclose(out, expected, atol=1e-6)
    # Attention over the whole row would differ: the check can fail.
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True).transpose(1, 2)
    assert not torch.allclose(whole, expected, atol=1e-3)


def test_packed_attention_honours_a_sliding_window():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out, _ = packed_attention.packed_attention(torch.nn.Module(), q, k, v, None, sliding_window=2,
                                                    position_ids=torch.arange(6)[None])
    i = torch.arange(6)
    window = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 2)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=window).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-6)


def test_stated_bounds_win_and_3d_positions_need_them():
    # An mrope model hands the attention 3-D (or no) positions: the bounds compute_values states rule.
    g = torch.Generator().manual_seed(3)
    lengths = [4, 6]
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(3))
    text_positions = torch.cat([torch.arange(m) for m in lengths])[None]
    expected = _reference_attention(q, k, v, lengths, None)
    with packed_attention.sequence_bounds(text_positions):
        for given in (None, text_positions[None].expand(3, 1, 10)):
            out, _ = packed_attention.packed_attention(torch.nn.Module(), q, k, v, None, position_ids=given)
            assert torch.allclose(out, expected, atol=1e-6)
    with pytest.raises(ValueError, match="no stated sequence bounds"):
        packed_attention.packed_attention(torch.nn.Module(), q, k, v, None,
                                          position_ids=text_positions[None].expand(3, 1, 10))


def test_packed_attention_soft_caps_logits():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) * 4 for _ in range(3))
    out, _ = packed_attention.packed_attention(torch.nn.Module(), q, k, v, None, scaling=0.5, softcap=3.0,
                                               position_ids=torch.arange(5)[None])
    scores = torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 3.0) * 3.0
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    expected = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-5)
    uncapped = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5).transpose(1, 2)
    assert not torch.allclose(uncapped, expected, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
def test_grouped_heads_reach_a_fused_cuda_kernel_in_packed_attention(monkeypatch, dtype, window):
    """issue 41, item 8: on CUDA only flash takes enable_gqa (bf16/fp16, no mask); fp32 or a masked
    call must arrive with repeated K/V heads, not enable_gqa (MATH, the whole score matrix). The
    values are today's CPU ones."""
    g = torch.Generator().manual_seed(5)
    lengths = [5, 8, 5, 1, 8]
    n = sum(lengths)
    q = torch.randn(1, 4, n, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, n, 16, generator=g).to(dtype) for _ in "kv")
    position_ids = torch.cat([torch.arange(m) for m in lengths])[None]

    def attend():
        return packed_attention.packed_attention(torch.nn.Module(), q, k, v, None, scaling=0.25, sliding_window=window,
                                                 position_ids=position_ids)[0]

    today = attend()
    calls = sdpa_calls_as_on_cuda(monkeypatch)
    torch.testing.assert_close(attend(), today)
    assert_fused_kernel_calls(calls)
    assert any(call["enable_gqa"] for call in calls) == (dtype == torch.bfloat16)
    assert any(call["masked"] for call in calls) == (window is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_heads_reach_a_fused_cuda_kernel_in_ulysses_padded_rows(monkeypatch, dtype):
    """issue 41, item 8: Ulysses over padded rows always passes a mask, so on CUDA its grouped K/V
    heads are repeated in every dtype; the values are today's CPU ones."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 7, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 7, 8, generator=g).to(dtype) for _ in "kv")
    key_mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)

    def attend():
        return ulysses._padded_attention(q, k, v, key_mask, dropout=0.0, scaling=None, sliding_window=None,
                                         softcap=None)

    today = attend()
    calls = sdpa_calls_as_on_cuda(monkeypatch)
    torch.testing.assert_close(attend(), today)
    assert_fused_kernel_calls(calls)
    assert [call["heads"] for call in calls] == [(4, 4, 4)]


def test_sdpa_keeps_heads_grouped_only_where_a_fused_kernel_takes_them():
    """issue 41, item 8: the decision, as a table (CPU's flash kernel takes enable_gqa in every
    dtype, masked or not; CUDA's flash only in bf16/fp16 without a mask)."""
    from critic_adapters.common.parallel.kernels import sdpa_broadcasts_kv

    table = {(device, dtype, masked): sdpa_broadcasts_kv(device, dtype, masked)
             for device in ("cpu", "cuda") for dtype in (torch.float32, torch.bfloat16, torch.float16)
             for masked in (False, True)}
    assert {key for key, grouped in table.items() if not grouped} == {
        ("cuda", torch.float32, False), ("cuda", torch.float32, True), ("cuda", torch.bfloat16, True),
        ("cuda", torch.float16, True)}


def test_packed_attention_refuses_a_padding_mask():
    packed_attention.register()
    with pytest.raises(ValueError, match="packed rows only"):
        packed_attention._refuse_padding_mask(attention_mask=torch.tensor([[1, 1, 0]]))
    assert packed_attention._refuse_padding_mask(attention_mask=torch.ones(1, 3)) is None


if __name__ == "__main__":
    run_pytest(__file__)
