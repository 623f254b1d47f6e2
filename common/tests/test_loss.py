"""value_loss: hand-computed values per mode, clipping, micro-batch invariance, masking, errors."""

import math

import pytest
import torch

from critic_adapters.common.learning.loss import AGG_MODES, explained_variance, loss_normalizer, value_loss
from critic_adapters.common.tests.helpers import run_pytest

# Two sequences; row 0 has 3 valid tokens, row 1 has 1 (and a masked position holding garbage).
VALUES = torch.tensor([[1.0, 2.0, 0.0, 5.0], [0.5, 9.0, 9.0, 9.0]])
OLD = torch.tensor([[0.8, 1.0, 0.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
RETURNS = torch.tensor([[1.5, 1.0, 0.0, 3.0], [2.0, float("nan"), 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]])


def per_token_by_hand(clip):
    # v, v_old, R per valid token, in order: (1,.8,1.5) (2,1,1) (5,5,3) (.5,0,2)
    rows = [(1.0, 0.8, 1.5), (2.0, 1.0, 1.0), (5.0, 5.0, 3.0), (0.5, 0.0, 2.0)]
    out = []
    for v, old, r in rows:
        unclipped = (v - r) ** 2
        if clip is None:
            out.append(0.5 * unclipped)
        else:
            vc = old + max(-clip, min(clip, v - old))
            out.append(0.5 * max(unclipped, (vc - r) ** 2))
    return out


@pytest.mark.parametrize("clip", [0.5, 0.2, None])
def test_every_mode_matches_hand_computation(clip):
    t = per_token_by_hand(clip)
    row0, row1 = t[0] + t[1] + t[2], t[3]
    expected = {
        "token-mean": (row0 + row1) / 4,
        "seq-mean-token-sum": (row0 + row1) / 2,
        "seq-mean-token-mean": (row0 / 3 + row1 / 1) / 2,
        "seq-mean-token-sum-norm": (row0 / 4 + row1 / 4) / 2,  # horizon = T = 4
    }
    for mode in AGG_MODES:
        loss, _ = value_loss(VALUES, OLD, RETURNS, MASK, clip_range=clip, agg_mode=mode)
        assert float(loss) == pytest.approx(expected[mode], rel=1e-6), mode


def test_clip_fraction_counts_tokens_where_the_clipped_term_wins():
    # clip 0.5: token (2,1,1): vc=1.5 -> (0.5)^2 > (1)^2? no. token (.5,0,2): vc=.5 -> same as v.
    # token (1,.8,1.5): v-old=.2 not clipped. So only a small clip changes anything:
    _, stats = value_loss(VALUES, OLD, RETURNS, MASK, clip_range=0.5)
    assert stats == {"clip_fraction": 0.0, "valid_tokens": 4}
    # clip 0.1: (1,.8,1.5): vc=.9 -> .36 > .25 yes; (2,1,1): vc=1.1 -> .01 < 1 no;
    # (5,5,3): same; (.5,0,2): vc=.1 -> 3.61 > 2.25 yes.
    _, stats = value_loss(VALUES, OLD, RETURNS, MASK, clip_range=0.1)
    assert stats["clip_fraction"] == pytest.approx(0.5)


def test_horizon_is_the_sum_norm_divisor():
    t = per_token_by_hand(0.5)
    loss, _ = value_loss(VALUES, OLD, RETURNS, MASK, agg_mode="seq-mean-token-sum-norm", horizon=10)
    assert float(loss) == pytest.approx((sum(t[:3]) / 10 + t[3] / 10) / 2, rel=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_four_micro_batches_add_up_to_the_mini_batch(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 8, 12
    weights = torch.randn(T, dtype=torch.float64, requires_grad=True)
    features = torch.randn(B, T, T, generator=g, dtype=torch.float64)
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    returns = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[3] = 0  # an all-masked sequence

    def grads_and_loss(splits):
        weights.grad = None
        normalizer = loss_normalizer(mask, mode)
        total = 0.0
        for idx in torch.arange(B).chunk(splits):
            values = features[idx] @ weights
            loss, _ = value_loss(values, old[idx], returns[idx], mask[idx], clip_range=0.3, agg_mode=mode,
                                 normalizer=normalizer, horizon=T)
            loss.backward()
            total += float(loss)
        return total, weights.grad.clone()

    loss1, grad1 = grads_and_loss(1)
    loss4, grad4 = grads_and_loss(4)
    assert abs(loss1 - loss4) <= 1e-6
    assert (grad1 - grad4).abs().max() <= 1e-6


def test_all_masked_micro_batch_contributes_zero_and_backpropagates():
    values = torch.randn(2, 3, requires_grad=True)
    loss, stats = value_loss(values, torch.zeros(2, 3), torch.full((2, 3), float("nan")), torch.zeros(2, 3))
    assert float(loss) == 0.0 and not math.isnan(float(loss))
    loss.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))
    assert stats == {"clip_fraction": 0.0, "valid_tokens": 0}
    # With a mini-batch normalizer too:
    loss, _ = value_loss(values, torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), normalizer=7.0)
    assert float(loss) == 0.0


def test_garbage_under_the_mask_never_leaks():
    values = torch.tensor([[1.0, float("inf")]], requires_grad=True)
    loss, _ = value_loss(values, torch.zeros(1, 2), torch.tensor([[0.0, float("nan")]]), torch.tensor([[1, 0]]))
    loss.backward()
    assert float(loss) == pytest.approx(0.5)  # v=1, R=0: max(1, (0.5 - 0)^2) / 2
    assert torch.isfinite(values.grad).all()


def test_non_finite_returns_raise():
    returns = RETURNS.clone()
    returns[0, 1] = float("nan")
    with pytest.raises(ValueError, match="returns has 1 non-finite"):
        value_loss(VALUES, OLD, returns, MASK)
    old = OLD.clone()
    old[0, 0] = float("inf")
    with pytest.raises(ValueError, match="old_values has 1 non-finite"):
        value_loss(VALUES, old, RETURNS, MASK)


def test_bad_mode_and_shapes():
    with pytest.raises(ValueError, match="agg_mode 'mean' is not one of"):
        value_loss(VALUES, OLD, RETURNS, MASK, agg_mode="mean")
    with pytest.raises(ValueError, match="same \\[B, T\\] shape"):
        value_loss(VALUES[:, :3], OLD, RETURNS, MASK)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.5), returns, mask) == pytest.approx(0.0)
    # 1 - Var[R - V]/Var[R] with V = R/2: Var[R/2] / Var[R] = 1/4
    assert explained_variance(returns / 2, returns, mask) == pytest.approx(0.75)
    assert math.isnan(explained_variance(returns, returns, torch.zeros(1, 4)))


if __name__ == "__main__":
    run_pytest(__file__)
