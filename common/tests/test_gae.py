"""gae (common/learning/gae.py) against a plain per-token loop and hand calculations: tool output
skipped, rewards off the response placed or refused, truncation bootstrapped, per-turn timesteps."""

import random
import re

import pytest
import torch

from critic_adapters.common.learning import data
from critic_adapters.common.learning.gae import gae, reverse_scan, turn_ids_problem
from critic_adapters.common.tests.helpers import run_pytest


def gae_loop(rewards, values, response_mask, gamma, lam, *, turn_ids=None, next_values=None):
    """The reference: per row, a Python loop over its timesteps from the last. Timesteps are the
    response tokens (runs of equal turn_ids with turn_ids); a reward off the response is added to
    the last response token before it; next_values[i] follows row i's last timestep (else 0).
    lam: a float or one per row. Returns (advantages, returns), float64 [N, T]."""
    rows, width = rewards.shape
    lams = [float(lam)] * rows if isinstance(lam, (int, float)) else [float(x) for x in lam]
    r_all, v_all, m_all = rewards.tolist(), values.tolist(), response_mask.tolist()
    ids_all = turn_ids.tolist() if turn_ids is not None else None
    advantages, returns = [[0.0] * width for _ in range(rows)], [[0.0] * width for _ in range(rows)]
    for i in range(rows):
        reward, steps, last = {}, [], None
        for t in range(width):
            if m_all[i][t]:
                reward[t] = r_all[i][t]
                if steps and ids_all is not None and ids_all[i][t] == ids_all[i][steps[-1][0]]:
                    steps[-1].append(t)
                else:
                    steps.append([t])
                last = t
            elif r_all[i][t] != 0:
                reward[last] += r_all[i][t]
        next_value = float(next_values[i]) if next_values is not None else 0.0
        running = 0.0
        for step in reversed(steps):
            value = v_all[i][step[0]]
            running = sum(reward[t] for t in step) + gamma * next_value - value + gamma * lams[i] * running
            for t in step:
                advantages[i][t], returns[i][t] = running, running + value
            next_value = value
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


def random_rollouts(rows: int, width: int, *, seed: int, off_mask_rewards: bool = False) -> dict:
    """Agentic rows: a prompt, then response turns (1-40 tokens) and tool outputs (0-20 tokens, so
    some turns touch) until the width; float64. With off_mask_rewards, some tool-output tokens
    after the first turn carry a reward (always the last one, when a row ends on a tool output)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mask, turns, off = torch.zeros(rows, width, dtype=torch.long), torch.full((rows, width), -1), []
    for i in range(rows):
        t, turn = rng.randint(1, max(1, min(16, width - 1))), 0
        while t < width:
            n = min(rng.randint(1, 40), width - t)
            mask[i, t:t + n], turns[i, t:t + n] = 1, turn
            t, turn = t + n, turn + rng.randint(1, 3)  # turn ids need not be consecutive
            gap = min(rng.randint(0, 20), width - t)
            off += [(i, p) for p in range(t, t + gap) if rng.random() < 0.1 or p == width - 1]
            t += gap
    rewards = torch.randn(rows, width, generator=g, dtype=torch.float64) * mask
    if off_mask_rewards:
        for i, p in off:
            rewards[i, p] = rng.gauss(0.0, 1.0)
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)  # off the response: never read
    return {"rewards": rewards, "values": values, "response_mask": mask, "turn_ids": turns}


def close(a, b, atol=1e-9):
    assert torch.allclose(a, b, rtol=0.0, atol=atol), (a - b).abs().max()


# --- today's behaviour, by hand -----------------------------------------------------------------
# One row: a prompt token, response tokens a, b, a tool token, response token c (values 5 and 7 off
# the response are never read). Compacted: r = [0, 1, 2], v = [1, 2, 3]; gamma = 0.5:
# deltas: c: 2 - 3 = -1; b: 1 + .5*3 - 2 = .5; a: 0 + .5*2 - 1 = 0.
# lam 1 (c = .5):   A = [0, 0, -1]          returns = A + v = [1, 2, 2] (Monte-Carlo).
# lam .5 (c = .25): A = [.0625, .25, -1].
# length-adaptive alpha .5, L = 3: lam = 1 - 1/1.5 = 1/3 (c = 1/6): A = [1/18, 1/3, -1].
HAND = dict(rewards=torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0], [0.0] * 5]),
            values=torch.tensor([[5.0, 1.0, 2.0, 7.0, 3.0], [1.0] * 5]),
            response_mask=torch.tensor([[0, 1, 1, 0, 1], [0] * 5]))


@pytest.mark.parametrize("function", [gae, data.gae], ids=["gae", "data.gae"])
def test_todays_numbers_by_hand(function):
    advantages, returns = function(**HAND, gamma=0.5, lam_critic=1.0, lam_policy=0.5)
    assert advantages.dtype == returns.dtype == torch.float32
    close(returns, torch.tensor([[0.0, 1.0, 2.0, 0.0, 2.0], [0.0] * 5]), 1e-7)
    close(advantages, torch.tensor([[0.0, 0.0625, 0.25, 0.0, -1.0], [0.0] * 5]), 1e-7)
    adaptive, _ = function(**HAND, gamma=0.5, lam_critic=1.0, length_adaptive_alpha=0.5)
    close(adaptive, torch.tensor([[0.0, 1 / 18, 1 / 3, 0.0, -1.0], [0.0] * 5]), 1e-7)
    same, _ = function(**HAND, gamma=0.5, lam_critic=1.0)
    close(same, returns - HAND["values"] * HAND["response_mask"], 1e-7)


# --- tool output between turns --------------------------------------------------------------------
def _two_turns(gap: int):
    """Turn 0 (4 tokens), `gap` tool tokens (value nan: never read; reward 0, turn -1), turn 1 (3 tokens)."""
    r = torch.tensor([0.1, 0.0, 0.3, 0.5] + [0.0] * gap + [0.0, -0.2, 1.0], dtype=torch.float64)
    v = torch.tensor([0.4, 0.2, -0.1, 0.3] + [float("nan")] * gap + [0.7, 0.5, 0.9], dtype=torch.float64)
    m = torch.tensor([1] * 4 + [0] * gap + [1] * 3)
    ids = torch.tensor([0] * 4 + [-1] * gap + [1] * 3)
    return r[None], v[None], m[None], ids[None]


@pytest.mark.parametrize("unit", ["token", "turn"])
@pytest.mark.parametrize("gamma", [0.99, 0.0])
@pytest.mark.parametrize("k", [1, 5, 50])
def test_tool_tokens_between_turns_change_nothing(k, gamma, unit):
    r0, v0, m0, ids0 = _two_turns(0)
    r, v, m, ids = _two_turns(k)
    kept = m[0].bool()
    for lam in ({"lam_policy": 0.95}, {"length_adaptive_alpha": 0.3}):
        a0, ret0 = gae(r0, v0, m0, gamma, 0.95, **lam, turn_ids=ids0, timestep_unit=unit)
        a, ret = gae(r, v, m, gamma, 0.95, **lam, turn_ids=ids, timestep_unit=unit)
        close(a[0, kept], a0[0], 1e-12)
        close(ret[0, kept], ret0[0], 1e-12)
        assert not a[0, ~kept].any() and not ret[0, ~kept].any()


# --- rewards off the response ---------------------------------------------------------------------
def _ends_on_tool_output(gamma):
    """Row 1 ends on 2 tool tokens with the trajectory's reward on the last one (miles' layout); the
    same row with that reward on its last response token instead."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 1, 1, 0, 0]])
    rewards = torch.zeros(2, 10, dtype=torch.float64)
    rewards[0, 9] = 0.5
    rewards[1, 9] = 1.0
    direct = rewards.clone()
    direct[1, 9], direct[1, 7] = 0.0, 1.0
    values = torch.linspace(-0.5, 0.5, 20, dtype=torch.float64).view(2, 10)
    return rewards, direct, values, mask


@pytest.mark.parametrize("gamma", [0.99, 0.0])
def test_a_reward_off_the_response_is_refused_or_moved_to_the_last_response_token_before_it(gamma):
    rewards, direct, values, mask = _ends_on_tool_output(gamma)
    with pytest.raises(ValueError, match=r"row 1 has reward 1.0 at position 9, outside response_mask.*"
                                         r"off_mask_rewards='previous' \(data.off_mask_rewards=previous\)"):
        gae(rewards, values, mask, gamma, 0.95)
    moved = gae(rewards, values, mask, gamma, 0.95, lam_policy=0.9, off_mask_rewards="previous")
    expected = gae(direct, values, mask, gamma, 0.95, lam_policy=0.9)
    for got, want in zip(moved, expected):
        close(got, want, 1e-12)
    # The reward is in the returns: at gamma 0 the last response token's return is exactly it.
    if gamma == 0.0:
        assert moved[1][1, 7] == pytest.approx(1.0)


def test_rewards_off_the_response_add_up_on_the_token_before_them():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    rewards = torch.tensor([[0.0, 0.25, 0.5, 1.0, 0.0, 2.0]], dtype=torch.float64)
    values = torch.zeros(1, 6, dtype=torch.float64)
    _, returns = gae(rewards, values, mask, 0.0, 1.0, off_mask_rewards="previous")
    close(returns, torch.tensor([[0.0, 1.75, 0.0, 0.0, 2.0, 0.0]], dtype=torch.float64), 1e-12)


def test_a_reward_off_the_response_with_no_response_token_before_it_is_refused():
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.3, 0.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="row 1 has reward 0.3.* at position 0, outside response_mask with no "
                                         "response token before it"):
        gae(rewards, torch.zeros(2, 4), mask, 0.9, 1.0, off_mask_rewards="previous")
    with pytest.raises(ValueError, match=r"off_mask_rewards='drop'; expected one of \('error', 'previous'\)"):
        gae(rewards, torch.zeros(2, 4), mask, 0.9, 1.0, off_mask_rewards="drop")


# --- truncation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_a_truncated_rows_returns_at_lambda_1_are_the_discounted_rewards_plus_the_bootstrap(gamma):
    rollouts = random_rollouts(3, 60, seed=1)
    rewards, values, mask = rollouts["rewards"], rollouts["values"], rollouts["response_mask"]
    bootstrap = torch.tensor([2.5, -1.0, 4.0], dtype=torch.float64)
    truncated = torch.tensor([True, True, False])
    _, returns = gae(rewards, values, mask, gamma, 1.0, truncated=truncated, bootstrap_values=bootstrap)
    for i in range(3):
        index = mask[i].nonzero().flatten()
        r, n = rewards[i, index].tolist(), len(index)
        b = float(bootstrap[i]) if truncated[i] else 0.0
        want = [sum(gamma ** k * r[j + k] for k in range(n - j)) + gamma ** (n - j) * b for j in range(n)]
        close(returns[i, index], torch.tensor(want, dtype=torch.float64))


def test_truncation_adds_gamma_times_the_bootstrap_to_the_last_delta():
    # Only the last delta changes, by gamma*b; GAE(lam) carries it back as (gamma*lam)^(n-1-j):
    # the return at compacted token j moves by gamma*b*(gamma*lam_critic)^(n-1-j), the advantage by
    # gamma*b*(gamma*lam_policy)^(n-1-j); the last token's return by exactly gamma*b.
    rollouts = random_rollouts(2, 50, seed=2)
    rewards, values, mask = rollouts["rewards"], rollouts["values"], rollouts["response_mask"]
    gamma, b = 0.97, torch.tensor([3.0, -2.0], dtype=torch.float64)
    plain = gae(rewards, values, mask, gamma, 0.95, lam_policy=0.8)
    cut = gae(rewards, values, mask, gamma, 0.95, lam_policy=0.8, truncated=torch.tensor([True, True]),
              bootstrap_values=b)
    for i in range(2):
        index = mask[i].nonzero().flatten()
        to_end = torch.arange(len(index) - 1, -1, -1, dtype=torch.float64)
        close(cut[1][i, index] - plain[1][i, index], gamma * b[i] * (gamma * 0.95) ** to_end)
        close(cut[0][i, index] - plain[0][i, index], gamma * b[i] * (gamma * 0.8) ** to_end)
        assert float(cut[1][i, index[-1]] - plain[1][i, index[-1]]) == pytest.approx(gamma * float(b[i]))


def test_rows_not_truncated_ignore_their_bootstrap_value():
    rollouts = random_rollouts(2, 40, seed=3)
    args = (rollouts["rewards"], rollouts["values"], rollouts["response_mask"], 0.99, 0.95)
    plain = gae(*args)
    mixed = gae(*args, truncated=torch.tensor([False, True]), bootstrap_values=torch.tensor([float("nan"), 1.0]))
    assert torch.equal(mixed[0][0], plain[0][0]) and torch.equal(mixed[1][0], plain[1][0])
    assert not torch.equal(mixed[1][1], plain[1][1])


def test_truncated_and_bootstrap_values_are_checked():
    rollouts = random_rollouts(2, 20, seed=4)
    args = (rollouts["rewards"], rollouts["values"], rollouts["response_mask"], 0.99, 0.95)
    with pytest.raises(ValueError, match="pass truncated and bootstrap_values together"):
        gae(*args, truncated=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="pass truncated and bootstrap_values together"):
        gae(*args, bootstrap_values=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"truncated \(3,\) and bootstrap_values \(2,\) must be \[N\] = \(2,\)"):
        gae(*args, truncated=torch.tensor([True, False, True]), bootstrap_values=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="truncated must be bool"):
        gae(*args, truncated=torch.tensor([1, 0]), bootstrap_values=torch.tensor([1.0, 2.0]))


# --- turns as timesteps ---------------------------------------------------------------------------
def test_one_token_per_turn_is_token_mode():
    rollouts = random_rollouts(4, 300, seed=5, off_mask_rewards=True)
    mask = rollouts["response_mask"]
    one_per_turn = torch.where(mask.bool(), mask.cumsum(dim=1) - 1, -1)
    args = (rollouts["rewards"], rollouts["values"], mask, 0.99, 0.95)
    kwargs = dict(length_adaptive_alpha=0.05, off_mask_rewards="previous", truncated=torch.tensor([1, 0, 1, 0]).bool(),
                  bootstrap_values=torch.tensor([1.0, 2.0, -3.0, 4.0]))
    tokens = gae(*args, **kwargs)
    turns = gae(*args, **kwargs, turn_ids=one_per_turn, timestep_unit="turn")
    close(turns[0], tokens[0], 1e-12)
    close(turns[1], tokens[1], 1e-12)


def test_turns_by_hand():
    # Turn ids 2 and 5 (need not be consecutive), a tool token between. gamma .9, lam .8:
    # turn 2: R = .5 + 0 = .5, V = 1 (its first token's; 9 is never read); turn 5: R = .25 + 1 = 1.25, V = 2.
    # delta5 = 1.25 - 2 = -.75, A5 = -.75; delta2 = .5 + .9*2 - 1 = 1.3, A2 = 1.3 + .72*(-.75) = .76.
    # returns: turn 2: .76 + 1 = 1.76; turn 5: -.75 + 2 = 1.25. Each broadcast to the turn's tokens.
    # Length-adaptive alpha 1 counts turns (L = 2): lam = .5, A2 = 1.3 + .45*(-.75) = .9625
    # (with L = 5 tokens, lam would be .8: .76).
    rewards = torch.tensor([[0.5, 0.0, 0.0, 0.0, 0.25, 1.0]], dtype=torch.float64)
    values = torch.tensor([[1.0, 9.0, 6.0, 2.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    turn_ids = torch.tensor([[2, 2, -1, 5, 5, 5]])
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8, turn_ids=turn_ids, timestep_unit="turn")
    close(advantages, torch.tensor([[0.76, 0.76, 0.0, -0.75, -0.75, -0.75]], dtype=torch.float64), 1e-12)
    close(returns, torch.tensor([[1.76, 1.76, 0.0, 1.25, 1.25, 1.25]], dtype=torch.float64), 1e-12)
    adaptive, same = gae(rewards, values, mask, 0.9, 0.8, length_adaptive_alpha=1.0, turn_ids=turn_ids,
                         timestep_unit="turn")
    close(adaptive, torch.tensor([[0.9625, 0.9625, 0.0, -0.75, -0.75, -0.75]], dtype=torch.float64), 1e-12)
    assert torch.equal(same, returns)


BAD_TURN_IDS = [
    ([-1, 0, -1, 1], "row 1: turn id -1 on response token 2 (response tokens take a turn id >= 0)"),
    ([0, 0, 0, 1], "row 1: turn id 0 at position 0, off the response (tokens off the response take -1)"),
    ([-1, 1, 0, 1], "row 1: turn ids decrease at position 2: 0 after 1 at position 1 (they must be "
                                                           "non-decreasing along the response)"),
]


@pytest.mark.parametrize("unit", ["turn", "token"])
@pytest.mark.parametrize("bad,message", BAD_TURN_IDS)
def test_bad_turn_ids_are_refused_by_name(bad, message, unit):
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]])
    turn_ids = torch.tensor([[-1, 0, 0, 1], bad])
    with pytest.raises(ValueError, match="bad turn_ids: " + re.escape(message)):
        gae(torch.zeros(2, 4), torch.zeros(2, 4), mask, 0.9, 1.0, turn_ids=turn_ids, timestep_unit=unit)
    assert turn_ids_problem(bad, [0, 1, 1, 1]) == message.removeprefix("row 1: ")
    assert turn_ids_problem(torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 1])) is None


def test_turn_mode_needs_turn_ids_and_token_mode_ignores_good_ones():
    rollouts = random_rollouts(3, 100, seed=6)
    args = (rollouts["rewards"], rollouts["values"], rollouts["response_mask"], 0.99, 0.95)
    with pytest.raises(ValueError, match="timestep_unit='turn' needs turn_ids"):
        gae(*args, timestep_unit="turn")
    with pytest.raises(ValueError, match=r"timestep_unit='step'; expected one of \('token', 'turn'\)"):
        gae(*args, timestep_unit="step", turn_ids=rollouts["turn_ids"])
    plain, with_ids = gae(*args), gae(*args, turn_ids=rollouts["turn_ids"])
    assert torch.equal(plain[0], with_ids[0]) and torch.equal(plain[1], with_ids[1])


# --- against the loop -----------------------------------------------------------------------------
@pytest.mark.parametrize("rows,width,gamma,lam_critic", [(1, 1, 0.99, 0.95), (3, 17, 0.99, 0.95), (5, 300, 0.9, 0.7),
                                                         (2, 20000, 1.0, 1.0), (3, 5000, 0.999, 1.0)])
@pytest.mark.parametrize("unit", ["token", "turn"])
def test_equal_to_the_per_token_loop(rows, width, gamma, lam_critic, unit):
    rollouts = random_rollouts(rows, width, seed=rows * width, off_mask_rewards=True)
    rewards, values, mask, turn_ids = (rollouts[k] for k in ("rewards", "values", "response_mask", "turn_ids"))
    truncated = torch.arange(rows) % 2 == 0
    bootstrap = torch.randn(rows, dtype=torch.float64)
    kwargs = dict(turn_ids=turn_ids, timestep_unit=unit, truncated=truncated, bootstrap_values=bootstrap,
                  off_mask_rewards="previous")
    loop = dict(turn_ids=turn_ids if unit == "turn" else None, next_values=torch.where(truncated, bootstrap, 0.0))
    advantages, returns = gae(rewards, values, mask, gamma, lam_critic, lam_policy=0.9, **kwargs)
    close(returns, gae_loop(rewards, values, mask, gamma, lam_critic, **loop)[1])
    close(advantages, gae_loop(rewards, values, mask, gamma, 0.9, **loop)[0])
    # Per-row lambda: length-adaptive over each row's timesteps (tokens, or turns).
    alpha = 0.02
    per_token = turn_ids if unit == "turn" else torch.arange(width).expand(rows, width)
    steps = torch.tensor([max(1, len(set(per_token[i][mask[i].bool()].tolist()))) for i in range(rows)],
                         dtype=torch.float64)
    lam_rows = (1 - 1 / (alpha * steps)).clamp(0, 1)
    adaptive, same = gae(rewards, values, mask, gamma, lam_critic, length_adaptive_alpha=alpha, **kwargs)
    close(adaptive, gae_loop(rewards, values, mask, gamma, lam_rows.tolist(), **loop)[0])
    assert torch.equal(same, returns)


@pytest.mark.parametrize("block", [2, 7, 64])
def test_the_blocked_scan_is_the_recurrence(block):
    x = torch.randn(4, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    c = torch.tensor([1.0, 0.95, 0.5, 0.0], dtype=torch.float64)
    want, running = torch.zeros_like(x), torch.zeros(4, dtype=torch.float64)
    for t in range(999, -1, -1):
        running = x[:, t] + c * running
        want[:, t] = running
    close(reverse_scan(x, c, block), want)
    close(reverse_scan(x, torch.full((4,), 0.9, dtype=torch.float64), block)[1:2],
          reverse_scan(x[1:2], torch.tensor([0.9], dtype=torch.float64), block))


def test_other_argument_errors():
    with pytest.raises(ValueError, match="lam_policy or length_adaptive_alpha, not both"):
        gae(**HAND, gamma=0.9, lam_critic=1.0, lam_policy=0.9, length_adaptive_alpha=0.05)
    with pytest.raises(ValueError, match=r"values \(2, 4\) and response_mask \(2, 5\) must be one \[N, T\] shape"):
        gae(HAND["rewards"], HAND["values"][:, :4], HAND["response_mask"], 0.9, 1.0)
    with pytest.raises(ValueError, match=r"turn_ids \(2, 4\) must have the rewards' shape \(2, 5\)"):
        gae(**HAND, gamma=0.9, lam_critic=1.0, turn_ids=torch.zeros(2, 4, dtype=torch.long))


if __name__ == "__main__":
    run_pytest(__file__)
