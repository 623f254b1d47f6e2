"""HL-Gauss (common/learning/hl_gauss.py) and decoupled GAE (common/learning/data.py: gae) against independent
implementations written here: the Gaussian CDF from torch.special.ndtr in float64, the loss from its
definition with autograd, GAE as the textbook per-row recursion over the response tokens."""

import re

import pytest
import torch

from critic_adapters.common.learning import hl_gauss
from critic_adapters.common.engine.config import HLGaussConfig, LossConfig, load_train_config
from critic_adapters.common.learning.data import gae
from critic_adapters.common.learning.hl_gauss import HLGaussHead, HLGaussSupport, bin_logits
from critic_adapters.common.learning.loss import hl_gauss_loss_terms
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.tests.helpers import run_pytest

SUPPORT = HLGaussSupport(num_bins=51, min_value=-2.0, max_value=3.0, sigma_ratio=0.75)


def reference_targets(y: torch.Tensor, s: HLGaussSupport) -> torch.Tensor:
    edges = torch.linspace(s.min_value, s.max_value, s.num_bins + 1, dtype=torch.float64)
    sigma = s.sigma_ratio * (s.max_value - s.min_value) / s.num_bins
    y = y.double().clamp(s.min_value, s.max_value)[..., None]
    cdf = torch.special.ndtr((edges - y) / sigma)
    return (cdf[..., 1:] - cdf[..., :-1]) / (cdf[..., -1:] - cdf[..., :1])


def centres(s: HLGaussSupport) -> torch.Tensor:
    edges = torch.linspace(s.min_value, s.max_value, s.num_bins + 1, dtype=torch.float64)
    return (edges[1:] + edges[:-1]) / 2


def test_targets_match_the_definition_sum_to_one_and_centre_on_the_return():
    y = torch.tensor([-5.0, -2.0, -1.3, 0.0, 0.77, 2.999, 3.0, 9.0])
    p = hl_gauss.targets(y, SUPPORT)
    assert p.shape == (8, 51) and p.dtype == torch.float32
    assert torch.allclose(p.double(), reference_targets(y, SUPPORT), atol=1e-6)
    assert torch.allclose(p.sum(-1), torch.ones(8), atol=1e-5)
    mean = (p.double() * centres(SUPPORT)).sum(-1)
    inside = (y > -1.5) & (y < 2.5)  # several sigmas from either edge
    assert torch.allclose(mean[inside], y[inside].double(), atol=1e-3 * SUPPORT.bin_width)
    # Edges: a return beyond the range is the edge's target; there half the Gaussian is cut off.
    assert torch.equal(p[0], p[1]) and torch.equal(p[-1], p[-2])
    assert float(p[1, :3].sum()) > 0.99 and mean[1] > -2.0


def test_expectation_and_the_head_give_values_and_bin_logits_on_request():
    logits = torch.randn(2, 5, 51, dtype=torch.float64)
    expected = (torch.softmax(logits, -1) * centres(SUPPORT)).sum(-1)
    assert torch.allclose(hl_gauss.expectation(logits, SUPPORT).double(), expected, atol=1e-6)
    head = HLGaussHead(16, SUPPORT)
    hidden = torch.randn(2, 5, 16)
    out = head(hidden)
    assert out.shape == (2, 5, 1) and out.dtype == torch.float32
    with bin_logits(torch.nn.Sequential(head)):
        bins = head(hidden)
    assert bins.shape == (2, 5, 51) and torch.allclose(out[..., 0], hl_gauss.expectation(bins, SUPPORT))
    assert head(hidden).shape == (2, 5, 1)  # back to values after the block
    assert set(dict(head.named_parameters())) == {"weight", "bias"}  # nn.Linear's names: plain state dicts


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_loss_and_its_gradient_match_cross_entropy_written_out(agg_mode):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 51, generator=g, dtype=torch.float64, requires_grad=True)
    returns = torch.randn(3, 7, generator=g) * 2
    mask = torch.zeros(3, 7, dtype=torch.long)
    mask[0, 2:] = 1
    mask[1, 4:6] = 1  # row 2: no response token
    returns[mask == 0] = float("inf")  # garbage off the response must not leak
    ce = -(reference_targets(returns.nan_to_num(posinf=0.0), SUPPORT) * torch.log_softmax(logits, -1)).sum(-1)
    m = mask.bool()
    if agg_mode == "token-mean":
        expected = ce[m].sum() / m.sum()
    else:
        sums = (ce * m).sum(-1)
        if agg_mode == "seq-mean-token-mean":
            sums = sums / m.sum(-1).clamp(min=1)
        expected = sums.sum() / m.any(-1).sum()
    (expected_grad,) = torch.autograd.grad(expected, logits)
    ours = logits.detach().float().requires_grad_(True)
    loss, valid = hl_gauss_loss_terms(ours, returns, mask, SUPPORT, agg_mode=agg_mode)
    loss.backward()
    assert int(valid) == int(m.sum())
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-5)
    assert torch.allclose(ours.grad.double(), expected_grad, atol=1e-6)
    # A normaliser over a larger mini-batch scales it, as the MSE loss does.
    half, _ = hl_gauss_loss_terms(ours.detach(), returns, mask, SUPPORT, agg_mode="token-mean", normalizer=2 * float(m.sum()))
    if agg_mode == "token-mean":
        assert float(half.detach()) == pytest.approx(float(expected.detach()) / 2, abs=1e-5)


def test_a_head_started_from_a_scalar_one_has_its_values():
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(1, 16, generator=g) * 0.1, torch.tensor([0.4])
    hidden = torch.randn(40, 16, generator=g)
    scalar = hidden @ weight.T[:, 0] + bias
    head = HLGaussHead(16, SUPPORT)
    w, b = hl_gauss.from_scalar_head(weight, bias, SUPPORT)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
    inside = (scalar > -1.5) & (scalar < 2.5)
    assert inside.sum() > 30
    assert torch.allclose(head(hidden)[:, 0][inside], scalar[inside], atol=1e-3 * SUPPORT.bin_width)


def test_bad_support_settings_are_one_line_naming_the_keys():
    cases = {
        "engine.loss.hl_gauss.min_value=1.0 must be below engine.loss.hl_gauss.max_value=1.0":
            ["engine.loss.hl_gauss.min_value=1.0", "engine.loss.hl_gauss.max_value=1.0"],
        "engine.loss.hl_gauss.num_bins=1 must be >= 2": ["engine.loss.hl_gauss.num_bins=1"],
        "engine.loss.clip_range=0.5 does not apply to engine.loss.kind=hl_gauss": ["engine.loss.clip_range=0.5"],
        "engine.loss.hl_gauss.min_value and engine.loss.hl_gauss.max_value are required":
            ["engine.loss.hl_gauss.min_value=null", "engine.loss.hl_gauss.max_value=null"],
        "engine.loss.hl_gauss.sigma_ratio=0.0 must be > 0": ["engine.loss.hl_gauss.sigma_ratio=0"],
    }
    good = ["engine.loss.kind=hl_gauss", "engine.loss.clip_range=null", "engine.loss.hl_gauss.min_value=-1",
            "engine.loss.hl_gauss.max_value=1"]
    assert load_train_config([], good).engine.loss.support == HLGaussSupport(51, -1.0, 1.0, 0.75)
    for message, overrides in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            load_train_config([], good + overrides)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"engine.loss.kind='huber': use one of mse, hl_gauss"):
        LossConfig(kind="huber")
    assert LossConfig().support is None  # mse: today's scalar head is the default
    assert LossConfig(kind="hl_gauss", clip_range=None, hl_gauss=HLGaussConfig(min_value=0, max_value=1)).support.num_bins == 51


def test_an_hl_gauss_critic_config_and_checkpoint_keep_their_support(tmp_path):
    from critic_adapters.common.valuehead import compute_values, load_critic, load_valuehead_model, save_critic
    from critic_adapters.common.valuehead.config import critic_class, critic_config
    from critic_adapters.common.valuehead.errors import CriticLoadError
    from transformers import AutoConfig

    config = critic_config(tiny_config("qwen2"), value_head=SUPPORT)
    assert config.num_labels == 51 and config.critic_value_head["max_value"] == 3.0
    assert critic_config(config).num_labels == 51  # kept by default
    assert critic_config(config, value_head=None).num_labels == 1 and not hasattr(critic_config(config, value_head=None), "critic_value_head")
    torch.manual_seed(0)
    model = critic_class(config)(config)
    save_critic(model, str(tmp_path / "hl"))
    loaded, report = load_critic(str(tmp_path / "hl"))
    ids = torch.randint(4, 900, (2, 9))
    values = compute_values(loaded, ids, torch.ones_like(ids))
    with torch.no_grad():
        expected = hl_gauss.expectation(model(input_ids=ids).logits, SUPPORT)  # the plain Linear's logits
    assert torch.allclose(values, expected, atol=1e-6) and report.head == "loaded"
    # verl's drop-in and trl's value path (value_model.score(hidden)) read values, never bins.
    verl = load_valuehead_model(str(tmp_path / "hl"), torch.float32, AutoConfig.from_pretrained(str(tmp_path / "hl")), False)
    assert torch.allclose(verl(input_ids=ids).logits[..., 0], values, atol=1e-6)
    hidden = loaded.model(input_ids=ids).last_hidden_state
    assert torch.allclose(loaded.score(hidden)[..., 0], values, atol=1e-6)
    # The CLI's `values` prints the same values (token-aligned: value of token t at position t - 1).
    import ast
    import contextlib
    import io

    from critic_adapters.common.valuehead.cli import main as cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli(["values", str(tmp_path / "hl"), "--tokens", " ".join(map(str, ids[0].tolist()))]) == 0
    line = next(l for l in printed.getvalue().splitlines() if l.startswith("values"))
    cli_values = torch.tensor(ast.literal_eval(line.split("  ")[1]))
    assert torch.allclose(cli_values[1:], values[0, :-1], atol=1e-5)
    # An HL-Gauss checkpoint asked for a scalar head (engine.loss.kind=mse) is refused, naming the keys.
    with pytest.raises(CriticLoadError, match=r"holds an HL-Gauss head \(51 bins over \[-2, 3\].*engine.loss.kind=hl_gauss.*"
                                              r"= 51/-2/3/0.75, or start a new head with engine.model.fresh_head=true"):
        load_critic(str(tmp_path / "hl"), value_head=None)
    other = HLGaussSupport(num_bins=11, min_value=-2.0, max_value=3.0)
    with pytest.raises(CriticLoadError, match=r"but an HL-Gauss head \(11 bins"):
        load_critic(str(tmp_path / "hl"), value_head=other)


def reference_gae(rewards, values, mask, gamma, lam_per_row):
    """Per row, over its response tokens in order (others skipped): the textbook backward recursion."""
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for row in range(rewards.shape[0]):
        index = mask[row].nonzero().flatten().tolist()
        lam = float(lam_per_row[row])
        next_value = running = 0.0
        for t in reversed(index):
            delta = float(rewards[row, t]) + gamma * next_value - float(values[row, t])
            running = delta + gamma * lam * running
            advantages[row, t] = running
            next_value = float(values[row, t])
    return advantages


def test_decoupled_and_length_adaptive_gae_equal_the_plain_recursion_with_each_lambda():
    g = torch.Generator().manual_seed(3)
    rows, width = 4, 30
    mask = torch.zeros(rows, width, dtype=torch.long)
    mask[0, 3:30] = 1
    mask[1, 5:12] = 1
    mask[1, 16:20] = 1  # a tool-output gap between two turns
    mask[2, 1:4] = 1    # a short response: its length-adaptive lambda is clamped to 0
    rewards = torch.randn(rows, width, generator=g) * mask
    values = torch.randn(rows, width, generator=g) * mask
    gamma = 0.99
    advantages, returns = gae(rewards, values, mask, gamma, lam_critic=1.0, lam_policy=0.9)
    critic = reference_gae(rewards, values, mask, gamma, [1.0] * rows)
    assert torch.allclose(returns.double(), (critic + values.double()) * mask, atol=1e-5)
    assert torch.allclose(advantages.double(), reference_gae(rewards, values, mask, gamma, [0.9] * rows), atol=1e-5)
    alpha = 0.05
    lengths = mask.sum(-1).double()
    lam_rows = (1 - 1 / (alpha * lengths.clamp(min=1))).clamp(0, 1)
    assert lam_rows[0] == pytest.approx(1 - 1 / (0.05 * 27)) and lam_rows[2] == 0.0
    adaptive, same_returns = gae(rewards, values, mask, gamma, lam_critic=1.0, length_adaptive_alpha=alpha)
    assert torch.equal(same_returns, returns)  # the critic's returns do not depend on the policy's lambda
    assert torch.allclose(adaptive.double(), reference_gae(rewards, values, mask, gamma, lam_rows), atol=1e-5)
    # Neither policy lambda: advantages with lam_critic, returns = advantages + values.
    plain_adv, plain_ret = gae(rewards, values, mask, gamma, lam_critic=0.95)
    assert torch.allclose(plain_ret, (plain_adv + values) * mask, atol=1e-6)
    with pytest.raises(ValueError, match="lam_policy or length_adaptive_alpha, not both"):
        gae(rewards, values, mask, gamma, 1.0, lam_policy=0.9, length_adaptive_alpha=0.05)


def test_data_lam_is_read_as_lam_critic_with_a_deprecation_line():
    with pytest.warns(FutureWarning, match="data.lam is deprecated: it is read as data.lam_critic=0.9"):
        config = load_train_config([], ["data.lam=0.9"])
    assert config.data.lam_critic == 0.9 and config.data.lam is None
    assert load_train_config([], ["data.lam_critic=0.8"]).data.lam_critic == 0.8
    with pytest.raises(ValueError, match="data.lam=0.9 and data.lam_critic=0.8 are the same setting"):
        load_train_config([], ["data.lam=0.9", "data.lam_critic=0.8"])


if __name__ == "__main__":
    run_pytest(__file__)
