"""GAE for agentic multi-turn rollouts: decoupled lambdas, tool output skipped, rewards off the
response placed (never dropped), truncated rows bootstrapped, per-token or per-turn timesteps, and
a blocked scan instead of a Python loop over tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

OFF_MASK_REWARDS = ("error", "previous")
TIMESTEP_UNITS = ("token", "turn")
BLOCK = 64  # timesteps per block of the scan: a [B, B] matmul per block, then log_B(T) levels of carries


def gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam_critic: float,
        lam_policy: float | None = None, length_adaptive_alpha: float | None = None, *,
        turn_ids: torch.Tensor | None = None, timestep_unit: str = "token", truncated: torch.Tensor | None = None,
        bootstrap_values: torch.Tensor | None = None, off_mask_rewards: str = "error",
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE over each row's response timesteps: (advantages for the policy, returns for the
    critic), both [N, T] in rewards.dtype and zero off the response; float64 inside.

    returns    = GAE(gamma, lam_critic) advantages + values (lam_critic = 1: Monte-Carlo returns);
    advantages = GAE(gamma, lam) with lam = lam_policy, or, with length_adaptive_alpha = a, per row
                 lam = clamp(1 - 1 / (a * L), 0, 1) for a response of L timesteps (tokens; turns in
                 turn mode) (VAPO: a = 0.05); neither given: lam_critic.

    Timesteps are the response tokens in order; tokens outside response_mask (tool output between
    turns) are skipped: no gamma/lambda step, no value. `values[t]` is the critic's value of the
    state before token t, read on response tokens only. The last timestep's next value is 0, or
    bootstrap_values[i] (V of the state after the row's last token) where truncated[i].

    off_mask_rewards: a non-zero reward outside response_mask is an error ("error"), or is added to
    the row's last response token before it ("previous", as miles places a trajectory's reward on
    its last position, even when that is tool output).

    timestep_unit="turn" (with turn_ids [N, T]: -1 off the response, >= 0 and non-decreasing on it):
    each run of equal ids is one timestep, with the sum of its tokens' rewards and the value of its
    first token; its advantage and return are broadcast to all its tokens (AReaL's
    gae_timestep_unit: turn). In token mode turn_ids are checked but not used.
    """
    mask = _check_inputs(rewards, values, response_mask, lam_critic, lam_policy, length_adaptive_alpha,
                         timestep_unit, turn_ids, off_mask_rewards)
    next_value = _bootstrap(truncated, bootstrap_values, rewards.shape[0], rewards.device)
    placed = _placed_rewards(rewards, mask, off_mask_rewards)
    starts = _turn_starts(turn_ids, mask) if timestep_unit == "turn" else mask  # [N, T]: a timestep's first token
    step = starts.cumsum(dim=1) - 1  # [N, T]: each response token's timestep
    steps = starts.sum(dim=1)  # [N]
    width = int(steps.max()) if steps.numel() else 0
    if width == 0:
        return torch.zeros_like(rewards), torch.zeros_like(rewards)
    r = _to_steps(torch.where(mask, step, width), placed, width, add=True)
    v = _to_steps(torch.where(starts, step, width), values.double(), width, add=False)
    critic = _advantages(r, v, steps, gamma, torch.full_like(next_value, float(lam_critic)), next_value)
    if length_adaptive_alpha is not None:
        lam = (1.0 - 1.0 / (length_adaptive_alpha * steps.double().clamp(min=1))).clamp(0.0, 1.0)
        policy = _advantages(r, v, steps, gamma, lam, next_value)
    elif lam_policy is not None and lam_policy != lam_critic:
        policy = _advantages(r, v, steps, gamma, torch.full_like(next_value, float(lam_policy)), next_value)
    else:
        policy = critic
    index = step.clamp(min=0)
    advantages = torch.where(mask, policy.gather(1, index), 0.0).to(rewards.dtype)
    returns = torch.where(mask, (critic + v).gather(1, index), 0.0).to(rewards.dtype)
    return advantages, returns


def turn_ids_problem(turn_ids_row: torch.Tensor | Sequence[int],
                     response_mask_row: torch.Tensor | Sequence[int]) -> str | None:
    """What is wrong with one row's turn ids, and where; None when they are fine (-1 off the
    response, >= 0 on it, non-decreasing along the response tokens)."""
    ids, on = [int(i) for i in _as_list(turn_ids_row)], [bool(m) for m in _as_list(response_mask_row)]
    if len(ids) != len(on):
        return f"turn_ids has {len(ids)} positions, response_mask {len(on)}"
    previous = None  # (position, id) of the last response token
    for position, (i, response) in enumerate(zip(ids, on)):
        if response and i < 0:
            return f"turn id {i} on response token {position} (response tokens take a turn id >= 0)"
        if not response and i != -1:
            return f"turn id {i} at position {position}, off the response (tokens off the response take -1)"
        if response:
            if previous is not None and i < previous[1]:
                return (f"turn ids decrease at position {position}: {i} after {previous[1]} at position "
                        f"{previous[0]} (they must be non-decreasing along the response)")
            previous = (position, i)
    return None


def _as_list(row) -> list:
    return row.tolist() if isinstance(row, torch.Tensor) else list(row)


def _check_inputs(rewards, values, response_mask, lam_critic, lam_policy, length_adaptive_alpha,
                  timestep_unit, turn_ids, off_mask_rewards) -> torch.Tensor:
    """The argument errors; returns the boolean response mask."""
    if lam_policy is not None and length_adaptive_alpha is not None:
        raise ValueError("gae: pass lam_policy or length_adaptive_alpha, not both")
    if length_adaptive_alpha is not None and not length_adaptive_alpha > 0:
        raise ValueError(f"gae: length_adaptive_alpha={length_adaptive_alpha} must be > 0")
    if off_mask_rewards not in OFF_MASK_REWARDS:
        raise ValueError(f"gae: off_mask_rewards={off_mask_rewards!r}; expected one of {OFF_MASK_REWARDS}")
    if timestep_unit not in TIMESTEP_UNITS:
        raise ValueError(f"gae: timestep_unit={timestep_unit!r}; expected one of {TIMESTEP_UNITS}")
    if rewards.dim() != 2 or values.shape != rewards.shape or response_mask.shape != rewards.shape:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must be one [N, T] shape")
    mask = response_mask.bool()
    if timestep_unit == "turn" and turn_ids is None:
        raise ValueError("gae: timestep_unit='turn' needs turn_ids (one turn id per response token)")
    if turn_ids is not None:
        _check_turn_ids(turn_ids, mask)
    return mask


def _check_turn_ids(turn_ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Vectorised check; messages (turn_ids_problem) only for the bad rows."""
    if turn_ids.shape != mask.shape:
        raise ValueError(f"gae: turn_ids {tuple(turn_ids.shape)} must have the rewards' shape {tuple(mask.shape)}")
    if turn_ids.dtype.is_floating_point or turn_ids.dtype == torch.bool:
        raise ValueError(f"gae: turn_ids must be integers, got {turn_ids.dtype}")
    on_bad = mask & (turn_ids < 0)
    off_bad = ~mask & (turn_ids != -1)
    # Off the response every id is -1 (else refused above), so the running max is the last response id.
    decrease = mask & (turn_ids < torch.cummax(torch.where(mask, turn_ids, -1), dim=1).values)
    bad_rows = (on_bad | off_bad | decrease).any(dim=1).nonzero().flatten().tolist()
    if bad_rows:
        problems = [f"row {row}: {turn_ids_problem(turn_ids[row], mask[row])}" for row in bad_rows[:3]]
        more = f" (and {len(bad_rows) - 3} more rows)" if len(bad_rows) > 3 else ""
        raise ValueError("gae: bad turn_ids: " + "; ".join(problems) + more)


def _bootstrap(truncated, bootstrap_values, rows: int, device) -> torch.Tensor:
    """The next value after each row's last timestep: bootstrap_values where truncated, else 0 ([N] float64)."""
    if (truncated is None) != (bootstrap_values is None):
        raise ValueError("gae: pass truncated and bootstrap_values together (the value of the state after a "
                         "truncated row's last token)")
    if truncated is None:
        return torch.zeros(rows, dtype=torch.float64, device=device)
    truncated, bootstrap_values = torch.as_tensor(truncated), torch.as_tensor(bootstrap_values)
    if truncated.shape != (rows,) or bootstrap_values.shape != (rows,):
        raise ValueError(f"gae: truncated {tuple(truncated.shape)} and bootstrap_values "
                         f"{tuple(bootstrap_values.shape)} must be [N] = ({rows},)")
    if truncated.dtype != torch.bool:
        raise ValueError(f"gae: truncated must be bool, got {truncated.dtype}")
    # where, not a product: a non-truncated row's bootstrap value (even nan) is not read.
    return torch.where(truncated.to(device), bootstrap_values.to(device, torch.float64), 0.0)


def _placed_rewards(rewards: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Rewards as float64 on the response tokens only, each reward off it moved per `mode` or refused."""
    placed = torch.where(mask, rewards.double(), 0.0)
    off = ~mask & (rewards != 0)
    if not off.any():
        return placed
    if mode == "error":
        row, position = (int(i) for i in off.nonzero()[0])
        raise ValueError(f"gae: row {row} has reward {float(rewards[row, position])} at position {position}, "
                         f"outside response_mask ({int(off.sum())} such rewards in the batch); put it on a response "
                         f"token, or pass off_mask_rewards='previous' (data.off_mask_rewards=previous) to add it "
                         f"to the row's last response token before it")
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last_response = torch.cummax(torch.where(mask, index, -1), dim=1).values  # [N, T]
    nowhere = off & (last_response < 0)
    if nowhere.any():
        row, position = (int(i) for i in nowhere.nonzero()[0])
        raise ValueError(f"gae: row {row} has reward {float(rewards[row, position])} at position {position}, "
                         f"outside response_mask with no response token before it "
                         f"(off_mask_rewards='previous' has nowhere to put it)")
    return placed.scatter_add_(1, last_response.clamp(min=0), torch.where(off, rewards.double(), 0.0))


def _turn_starts(turn_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T]: the response tokens whose turn id differs from the previous response token's."""
    # Valid ids are -1 off the response and non-decreasing on it: the running max is the last turn's id.
    before = torch.cummax(torch.where(mask, turn_ids, -1), dim=1).values
    before = torch.nn.functional.pad(before[:, :-1], (1, 0), value=-1)
    return mask & (turn_ids != before)


def _to_steps(index: torch.Tensor, x: torch.Tensor, width: int, *, add: bool) -> torch.Tensor:
    """[N, T] token entries to [N, width] timesteps (summed or written); index `width` is discarded."""
    out = torch.zeros(x.shape[0], width + 1, dtype=x.dtype, device=x.device)
    return (out.scatter_add_(1, index, x) if add else out.scatter_(1, index, x))[:, :width]


def _advantages(r, v, steps, gamma: float, lam: torch.Tensor, next_value: torch.Tensor) -> torch.Tensor:
    """GAE advantages over compacted timesteps [N, M] (zeros after each row's `steps`), per-row lam."""
    following = torch.zeros_like(v)
    following[:, :-1] = v[:, 1:]
    # After the last timestep: the bootstrap value (a row without timesteps has only zeros).
    following.scatter_(1, (steps - 1).clamp(min=0)[:, None], torch.where(steps > 0, next_value, 0.0)[:, None])
    delta = r + gamma * following - v
    return reverse_scan(delta, gamma * lam)


def reverse_scan(x: torch.Tensor, c: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """y_t = x_t + c * y_{t+1} along dim 1 (y after the end = 0), c per row [N]: within blocks of
    `block` steps a matmul with the matrix of powers c^(j-i), then the same scan over the blocks'
    first entries (coefficient c^block) carries each block into the one before it."""
    assert block >= 2, block  # the carries' scan is `block` times shorter
    rows, length = x.shape
    size = min(block, length)
    blocks = -(-length // size)
    xb = torch.nn.functional.pad(x, (0, blocks * size - length)).view(rows, blocks, size)  # [N, K, B]
    i = torch.arange(size, device=x.device, dtype=x.dtype)
    gap = i[None, :] - i[:, None]  # [B, B]: j - i
    c = c.to(x)
    uniform = bool((c == c[0]).all())
    powers = torch.where(gap >= 0, (c[:1] if uniform else c)[:, None, None] ** gap.clamp(min=0), 0.0)
    local = xb @ (powers[0] if uniform else powers).transpose(-1, -2)  # [N, K, B]
    if blocks > 1:
        heads = reverse_scan(local[:, :, 0], c ** size, block)  # [N, K]: y at each block's first step
        carry = torch.nn.functional.pad(heads[:, 1:], (0, 1))  # the next block's first y
        local = local + carry[:, :, None] * c[:, None, None] ** (size - i)
    return local.reshape(rows, blocks * size)[:, :length]
