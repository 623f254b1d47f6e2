"""The embedded multi-turn rollout set (`data.train_path: embedded:multi_turn`): rollouts as an agent
loop records them, generated deterministically from the seed.

  prompt     [1, task, filler...]: one of 16 task tokens (TASK_TOKENS), each with a hidden value in [0, 2]
  turns      2-4 turns of 4-16 action tokens (response_mask 1, turn_ids k), a tool output between
             turns: [TOOL_OPEN, 3-12 noise tokens, TOOL_CLOSE] (response_mask 0, turn_ids -1); the
             returns never depend on the noise
  reward     the task's value + 0.5 x (share of even action tokens - 0.5), on the row's last position:
             its last action token, or, for ~30% of rows that end on a tool output, that output's last
             token, off the response (as verl's agent loop places it): run with
             data.off_mask_rewards=previous, which moves it to the last action token
  truncated  ~15% of rows are cut off at their turn limit: no reward, `truncated: true`; their
             returns bootstrap from the critic's value after their last token

The task values are positive, so a truncated row's return taken as terminal (0) is biased low by
about the mean outcome (1.0): bench/multi_turn.py measures what bootstrapping and turn-level GAE change.
"""

from __future__ import annotations

import torch

from .data import FILLER_TOKENS, TASK_TOKENS

TOOL_OPEN, TOOL_CLOSE = 4, 5
TOOL_NOISE = (30, 100)  # token ids of tool output, apart from the task and filler tokens
ENDS_ON_TOOL = 0.3
TRUNCATED = 0.15


def _randint(low: int, high: int, g: torch.Generator, n: int | None = None):
    """An int in [low, high) (or a list of n of them)."""
    if n is None:
        return int(torch.randint(low, high, (1,), generator=g))
    return torch.randint(low, high, (n,), generator=g).tolist()


def make_multi_turn_records(num_rollouts: int, seed: int = 0, *, outcomes: list | None = None) -> list[dict]:
    """`num_rollouts` multi-turn rollouts (see the module docstring); `outcomes`, when given, gets each
    row's would-be final reward (a truncated row's too: what it would have earned had it ended)."""
    g = torch.Generator().manual_seed(seed)
    task_value = torch.linspace(0.0, 2.0, len(TASK_TOKENS))[torch.randperm(len(TASK_TOKENS), generator=g)]
    records = []
    for _ in range(num_rollouts):
        task = _randint(0, len(TASK_TOKENS), g)
        ids = [1, TASK_TOKENS[task]] + _randint(*FILLER_TOKENS, g, _randint(2, 11, g))
        mask, turn_ids = [0] * len(ids), [-1] * len(ids)
        turns = _randint(2, 5, g)
        ends_on_tool = bool(torch.rand(1, generator=g) < ENDS_ON_TOOL)
        truncated = bool(torch.rand(1, generator=g) < TRUNCATED)
        actions: list[int] = []
        for turn in range(turns):
            action = _randint(*FILLER_TOKENS, g, _randint(4, 17, g))
            ids, mask, turn_ids = ids + action, mask + [1] * len(action), turn_ids + [turn] * len(action)
            actions += action
            if turn < turns - 1 or ends_on_tool:
                tool = [TOOL_OPEN] + _randint(*TOOL_NOISE, g, _randint(3, 13, g)) + [TOOL_CLOSE]
                ids, mask, turn_ids = ids + tool, mask + [0] * len(tool), turn_ids + [-1] * len(tool)
        outcome = float(task_value[task]) + 0.5 * (sum(1 for t in actions if t % 2 == 0) / len(actions) - 0.5)
        rewards = [0.0] * len(ids)
        if not truncated:
            rewards[-1] = outcome
        if outcomes is not None:
            outcomes.append(outcome)
        records.append({"input_ids": ids, "response_mask": mask, "rewards": rewards, "turn_ids": turn_ids,
                        "truncated": truncated})
    return records
