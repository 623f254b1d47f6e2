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


def read_records(path: str) -> list:
    """The rows of a .parquet, .jsonl (one object per line) or .json (an array of objects, or lines) file."""
    if not os.path.isfile(path):
        raise ValueError(f"rollout file {path} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"rollout file {path}: use .parquet, .jsonl or .json")
    with open(path) as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
        return records
    records = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({err}); expected one JSON object (a rollout) "
                                 f"per line, or a .json file holding one array of them") from None
    return records


def _kind(value) -> str:
    """A short description of a wrong value for an error message: its type and a clipped repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ids_problem(ids, vocab_size: int) -> str | None:
    """Why `ids` is not a non-empty flat list of integer ids in [0, vocab_size), or None."""
    if not isinstance(ids, (list, tuple)):
        return f"input_ids: expected a list of integer token ids, got {_kind(ids)}"
    if not ids:
        return "empty input_ids"
    for position, token in enumerate(ids):
        # Integral floats (a Parquet double column) are fine; 100.7 is not a token id.
        if not _is_number(token) or (isinstance(token, float) and not token.is_integer()):
            return f"input_ids: expected integer token ids, got {_kind(token)} at position {position}"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"token ids {bad[:5]} are outside the model's vocabulary [0, {vocab_size})"
    return None


def _per_token_problem(values, name: str, n: int) -> str | None:
    """Why `values` is not a list of n numbers (one per token), or None."""
    if not isinstance(values, (list, tuple)):
        return f"{name}: expected a list of {n} numbers (one per token), got {_kind(values)}"
    if len(values) != n:
        return f"{name} has {len(values)} entries but input_ids has {n}"
    for position, value in enumerate(values):
        if not _is_number(value):
            return f"{name}: expected numbers, got {_kind(value)} at position {position}"
    return None


PER_TOKEN = ("input_ids", "response_mask") + TARGETS + OPTIONAL


def validate_records(records: list, vocab_size: int, source: str, *, max_positions: int | None = None,
                     truncate: bool = False, targets: bool = True) -> list[str]:
    """Raise one ValueError that names the file, the row and the field for the first problems found.

    Rows longer than `max_positions` tokens are refused, or, with `truncate`, cut to that length in
    place. `targets=False` (values only, no training) needs no returns or rewards. A field missing
    from every row is one line. Returns notes worth telling the user (rows cut, rows without
    response tokens).
    """
    if not records:
        raise ValueError(f"{source} holds no rollouts")
    problems, notes = [], []
    first = next((r for r in records if isinstance(r, dict)), {})
    fields = set(first)
    has_target = [t for t in TARGETS if t in fields]
    dicts = [r for r in records if isinstance(r, dict)]
    absent = [f for f in REQUIRED if dicts and all(r.get(f) is None for r in dicts)]
    if absent:
        raise ValueError(f"invalid rollouts in {source}: no row has the field(s) {absent} (fields present: "
                         f"{sorted(fields)}); docs/DATA.md has the schema")
    if not targets:
        has_target = []
    elif not has_target:
        problems.append(f"no 'returns' or 'rewards' field (fields present: {sorted(fields)}); every rollout needs one")
    elif len(has_target) == 2:
        problems.append("both 'returns' and 'rewards' are present; give exactly one")
    with_old = [row for row, r in enumerate(records) if isinstance(r, dict) and r.get("old_values") is not None]
    if with_old and len(with_old) < len(records):
        have = set(with_old)
        without = next(row for row in range(len(records)) if row not in have)
        problems.append(f"row {without}: missing field 'old_values' (row {with_old[0]} has it); give old_values in "
                        f"every row or in none")
    truncated = no_response = 0
    for row, record in enumerate(records):
        if len(problems) >= 10:
            break
        if not isinstance(record, dict):
            problems.append(f"row {row}: expected an object with fields input_ids, response_mask, returns or "
                            f"rewards, got {_kind(record)}")
            continue
        missing = [f for f in REQUIRED + tuple(has_target[:1]) if f not in record or record[f] is None]
        if missing:
            problems.append(f"row {row}: missing field(s) {missing}")
            continue
        ids = record["input_ids"]
        problem = _ids_problem(ids, vocab_size)
        if problem:
            problems.append(f"row {row}: {problem}")
            continue
        n = len(ids)
        per_token = ("response_mask", *has_target[:1], *(f for f in OPTIONAL if record.get(f) is not None))
        row_problems = [p for p in (_per_token_problem(record[name], name, n) for name in per_token) if p]
        if row_problems:
            problems += [f"row {row}: {p}" for p in row_problems]
            continue
        if max_positions is not None and n > max_positions:
            if not truncate:
                problems.append(f"row {row}: input_ids has {n} tokens, more than the model's max_position_embeddings "
                                f"({max_positions}); shorten it, or set data.truncate_to_max_positions=true to cut "
                                f"such rows to {max_positions} tokens")
                continue
            for name in PER_TOKEN:
                if record.get(name) is not None:
                    record[name] = record[name][:max_positions]
            truncated += 1
        mask = record["response_mask"]
        if any(m not in (0, 1) for m in mask):
            problems.append(f"row {row}: response_mask must hold only 0 and 1")
            continue
        if mask[0] == 1:
            problems.append(f"row {row}: response_mask[0] is 1, but the first token has no preceding state to value")
        no_response += not any(mask)
        for name in per_token[1:]:
            bad = [i for i, (v, m) in enumerate(zip(record[name], mask)) if m and not math.isfinite(v)]
            if bad:
                problems.append(f"row {row}: {name} is NaN/inf at response positions {bad[:5]}")
    if not problems and no_response == len(records):
        problems.append("no row has a response token (response_mask is 0 everywhere), so there is nothing to train "
                        "on; mark the response tokens with 1")
    if problems:
        raise ValueError(f"invalid rollouts in {source}:\n  " + "\n  ".join(problems[:10]))
    if truncated:
        notes.append(f"{source}: cut {truncated} of {len(records)} rollouts to the model's max_position_embeddings "
                     f"({max_positions} tokens; data.truncate_to_max_positions=true)")
    if no_response:
        notes.append(f"warning: {no_response} of {len(records)} rollouts in {source} have no response tokens "
                     f"(response_mask all 0); they add nothing to training")
    return notes


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


def load_rollouts(path: str, vocab_size: int, *, max_positions: int | None = None, truncate: bool = False,
                  notes: list[str] | None = None) -> Rollouts:
    """Read and validate a rollout file; what validate_records reports is appended to `notes`."""
    records = read_records(path)
    found = validate_records(records, vocab_size, path, max_positions=max_positions, truncate=truncate)
    if notes is not None:
        notes += found
    return to_rollouts(records)


def split_held_out(rollouts: Rollouts, data, *, seed: int) -> tuple[Rollouts, Rollouts]:
    """(train, held out): a seeded random data.eval_fraction of the rollouts (at least one) held out
    for evaluation; data is the DataConfig. ValueError when either share would be empty."""
    order = torch.randperm(len(rollouts), generator=torch.Generator().manual_seed(seed))
    count = int(round(len(rollouts) * data.eval_fraction))
    if data.eval_fraction > 0 and count == 0:
        count = 1
    train, held_out = rollouts.select(order[count:]), rollouts.select(order[:count])
    if len(held_out) == 0:
        raise ValueError("data.eval_fraction=0 and no data.eval_path: the held-out evaluation needs rollouts; "
                         "set data.eval_fraction > 0 or give data.eval_path")
    if len(train) == 0:
        raise ValueError(f"{data.train_path} holds {len(rollouts)} rollout(s): holding out "
                         f"data.eval_fraction={data.eval_fraction} of them (at least one) for evaluation leaves "
                         f"none to train on; give more rollouts, or the held-out ones as data.eval_path")
    return train, held_out


def gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam_critic: float,
        lam_policy: float | None = None, length_adaptive_alpha: float | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE over each row's response tokens: (advantages for the policy, returns for the
    critic), both [N, T] and zero off the response.

    returns    = GAE(gamma, lam_critic) advantages + values (lam_critic = 1: Monte-Carlo returns,
                 what VAPO and VC-PPO train the critic on);
    advantages = GAE(gamma, lam) with lam = lam_policy, or, with length_adaptive_alpha = a, per row
                 lam = 1 - 1 / (a * L) for a response of L tokens (VAPO: a = 0.05), clamped to
                 [0, 1] (short responses get 0: one-step TD); neither given: lam_critic.

    The recursion runs over the response tokens in order, skipping non-response tokens (tool output
    between turns): they are compacted to the left of an [N, R] buffer, and the zeros after each
    row's last token end it (next value 0, next advantage 0). `values` are the critic's predictions
    for those tokens.
    """
    if lam_policy is not None and length_adaptive_alpha is not None:
        raise ValueError("gae: pass lam_policy or length_adaptive_alpha, not both")
    if length_adaptive_alpha is not None and not length_adaptive_alpha > 0:
        raise ValueError(f"gae: length_adaptive_alpha={length_adaptive_alpha} must be > 0")
    mask = response_mask.bool()
    counts = mask.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    slots = torch.arange(width)[None] < counts[:, None]
    r = torch.zeros(rewards.shape[0], width, dtype=torch.float64)
    v = torch.zeros_like(r)
    r[slots], v[slots] = rewards[mask].double(), values[mask].double()

    def advantages_with(lam: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(r)
        next_value = next_advantage = torch.zeros(rewards.shape[0], dtype=torch.float64)
        for t in range(width - 1, -1, -1):
            delta = r[:, t] + gamma * next_value - v[:, t]
            next_advantage = delta + gamma * lam * next_advantage
            out[:, t] = next_advantage
            next_value = v[:, t]
        return out

    rows = rewards.shape[0]
    critic_adv = advantages_with(torch.full((rows,), float(lam_critic), dtype=torch.float64))
    if length_adaptive_alpha is not None:
        lam = (1.0 - 1.0 / (length_adaptive_alpha * counts.double().clamp(min=1))).clamp(0.0, 1.0)
        policy_adv = advantages_with(lam)
    elif lam_policy is not None and lam_policy != lam_critic:
        policy_adv = advantages_with(torch.full((rows,), float(lam_policy), dtype=torch.float64))
    else:
        policy_adv = critic_adv
    returns, advantages = torch.zeros_like(rewards), torch.zeros_like(rewards)
    returns[mask] = (critic_adv + v)[slots].to(rewards.dtype)
    advantages[mask] = policy_adv[slots].to(rewards.dtype)
    return advantages, returns


def gae_returns(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                gamma: float, lam: float) -> torch.Tensor:
    """The critic's GAE(gamma, lam) returns alone (gae's second output)."""
    return gae(rewards, values, response_mask, gamma, lam)[1]


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
