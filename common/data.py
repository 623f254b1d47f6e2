"""Rollout data: reading Parquet/JSONL, validation, GAE returns, and the embedded default set.

Schema (one rollout per row/line; docs/DATA.md):
  input_ids      list[int]    prompt + response tokens, no padding
  response_mask  list[int]    1 on response tokens (the ones the critic is trained on), same length
  returns        list[float]  per-token return targets, same length            } one of
  rewards        list[float]  per-token rewards (GAE with the critic's values) } these two
  old_values     list[float]  optional: the rollout critic's predictions (else computed at start)
Per-token fields are aligned with input_ids: entry t belongs to token t, whose value the critic
predicts at position t - 1. Token 0 can therefore never be a response token.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

REQUIRED = ("input_ids", "response_mask")
TARGETS = ("returns", "rewards")
OPTIONAL = ("old_values",)


@dataclasses.dataclass(slots=True)
class Rollouts:
    """A set of rollouts as right-padded [N, T] tensors."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    returns: torch.Tensor | None
    rewards: torch.Tensor | None
    old_values: torch.Tensor | None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index) -> "Rollouts":
        """Rows `index`, trimmed to their longest sequence."""
        length = int(self.attention_mask[index].sum(dim=1).max()) if len(index) else 0
        pick = lambda t: None if t is None else t[index, :length]  # noqa: E731
        return Rollouts(*(pick(getattr(self, f.name)) for f in dataclasses.fields(self)))


def read_records(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise ValueError(f"rollout file {path} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith((".jsonl", ".json")):
        records = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{line_no} is not valid JSON ({err})") from None
        return records
    raise ValueError(f"rollout file {path}: use .parquet or .jsonl")


def validate_records(records: list[dict], vocab_size: int, source: str) -> None:
    """Raise one ValueError that names the file, the row and the field for the first problems found."""
    if not records:
        raise ValueError(f"{source} holds no rollouts")
    problems = []
    fields = set(records[0])
    has_target = [t for t in TARGETS if t in fields]
    if not has_target:
        problems.append(f"no 'returns' or 'rewards' field (fields present: {sorted(fields)}); every rollout needs one")
    elif len(has_target) == 2:
        problems.append("both 'returns' and 'rewards' are present; give exactly one")
    for row, record in enumerate(records):
        missing = [f for f in REQUIRED + tuple(has_target[:1]) if f not in record or record[f] is None]
        if missing:
            problems.append(f"row {row}: missing field(s) {missing}")
            continue
        ids = record["input_ids"]
        n = len(ids)
        if n == 0:
            problems.append(f"row {row}: empty input_ids")
            continue
        for name in ("response_mask", *has_target[:1], *(f for f in OPTIONAL if record.get(f) is not None)):
            if len(record[name]) != n:
                problems.append(f"row {row}: {name} has {len(record[name])} entries but input_ids has {n}")
        bad_ids = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad_ids:
            problems.append(f"row {row}: token ids {bad_ids[:5]} are outside the model's vocabulary [0, {vocab_size})")
        mask = record["response_mask"]
        if any(m not in (0, 1) for m in mask):
            problems.append(f"row {row}: response_mask must hold only 0 and 1")
        elif mask and mask[0] == 1:
            problems.append(f"row {row}: response_mask[0] is 1, but the first token has no preceding state to value")
        for name in (*has_target[:1], *(f for f in OPTIONAL if record.get(f) is not None)):
            values = record[name]
            bad = [i for i, (v, m) in enumerate(zip(values, mask)) if m and not math.isfinite(float(v))]
            if bad:
                problems.append(f"row {row}: {name} is NaN/inf at response positions {bad[:5]}")
        if len(problems) >= 10:
            break
    if problems:
        raise ValueError(f"invalid rollouts in {source}:\n  " + "\n  ".join(problems[:10]))


def to_rollouts(records: list[dict]) -> Rollouts:
    n, length = len(records), max(len(r["input_ids"]) for r in records)

    def padded(name, dtype):
        if records[0].get(name) is None:
            return None
        out = torch.zeros(n, length, dtype=dtype)
        for i, r in enumerate(records):
            values = r[name]
            out[i, : len(values)] = torch.tensor(values, dtype=dtype)
        return out

    input_ids = padded("input_ids", torch.long)
    attention_mask = torch.zeros(n, length, dtype=torch.long)
    for i, r in enumerate(records):
        attention_mask[i, : len(r["input_ids"])] = 1
    return Rollouts(input_ids, attention_mask, padded("response_mask", torch.long), padded("returns", torch.float32),
                    padded("rewards", torch.float32), padded("old_values", torch.float32))


def load_rollouts(path: str, vocab_size: int) -> Rollouts:
    records = read_records(path)
    validate_records(records, vocab_size, path)
    return to_rollouts(records)


def gae_returns(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                gamma: float, lam: float) -> torch.Tensor:
    """GAE(gamma, lambda) returns over each row's response tokens (in order, skipping non-response
    tokens such as tool output between turns); `values` are the critic's predictions for those tokens.

    Response tokens are compacted to the left of an [N, R] buffer; the zeros after each row's last
    token make the recursion end there (next value 0, next advantage 0).
    """
    mask = response_mask.bool()
    counts = mask.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    slots = torch.arange(width)[None] < counts[:, None]
    r = torch.zeros(rewards.shape[0], width, dtype=torch.float64)
    v = torch.zeros_like(r)
    r[slots], v[slots] = rewards[mask].double(), values[mask].double()
    advantages = torch.zeros_like(r)
    next_value = next_advantage = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for t in range(width - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage
        next_value = v[:, t]
    returns = torch.zeros_like(rewards)
    returns[mask] = (advantages + v)[slots].to(rewards.dtype)
    return returns


# --- the embedded default rollout set -----------------------------------------------------------
# Each prompt carries a "task" token whose hidden value sets the final reward; the response's own
# tokens add a smaller, token-dependent part. A critic can learn the task values from the prompt and
# refine them as it reads the response: returns depend on the tokens in a learnable way.
TASK_TOKENS = range(10, 26)
FILLER_TOKENS = (100, 1000)


def make_default_records(num_rollouts: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    task_value = torch.linspace(-1.0, 1.0, len(TASK_TOKENS))[torch.randperm(len(TASK_TOKENS), generator=g)]
    records = []
    for _ in range(num_rollouts):
        task = int(torch.randint(len(TASK_TOKENS), (1,), generator=g))
        prompt_len = int(torch.randint(2, 11, (1,), generator=g))
        response_len = int(torch.randint(8, 49, (1,), generator=g))
        prompt = [1, TASK_TOKENS[task]] + torch.randint(*FILLER_TOKENS, (prompt_len,), generator=g).tolist()
        response = torch.randint(*FILLER_TOKENS, (response_len,), generator=g).tolist()
        # Token-dependent part: the share of even tokens in the response, centred (+-0.5 at most).
        bonus = 0.5 * (sum(1 for t in response if t % 2 == 0) / response_len - 0.5)
        rewards = [0.0] * (len(prompt) + response_len)
        rewards[-1] = float(task_value[task]) + bonus
        records.append({
            "input_ids": prompt + response,
            "response_mask": [0] * len(prompt) + [1] * response_len,
            "rewards": rewards,
        })
    return records
