"""Rollout data: reading Parquet/JSONL, validation, GAE returns, and the embedded default set.

Schema (one rollout per row/line; docs/DATA.md):
  input_ids      list[int]    prompt + response tokens, no padding
  response_mask  list[int]    1 on response tokens (the ones the critic is trained on), same length
  returns        list[float]  per-token return targets, same length            } one of
  rewards        list[float]  per-token rewards (GAE with the critic's values) } these two
  old_values     list[float]  optional: the rollout critic's predictions (else computed at start)
  value_mask     list[int]    optional: 1 on the response tokens the critic regresses (default: all)
  turn_ids       list[int]    optional: -1 off the response, the turn's index (>= 0, non-decreasing) on it
  truncated      bool         optional, per row: cut off (a turn or token limit), not ended; its
                              GAE returns bootstrap from the critic's value after its last token
  version        int          optional, per row, with old_values: the critic version (optimizer
                              steps) that computed them; the job reports their staleness
  multi_modal_inputs  object  optional, per row: the processor's arrays of the row's images/videos
                              (pixel_values, image_grid_thw, ...; common/learning/media.py), or null;
                              input_ids then hold the expanded placeholder tokens
Per-token fields are aligned with input_ids: entry t belongs to token t, whose value the critic
predicts at position t - 1. Token 0 can therefore never be a response token.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import torch

# gae: where callers have always found it (the GAE itself is common/learning/gae.py)
from .gae import OFF_MASK_REWARDS, TIMESTEP_UNITS, gae, turn_ids_problem  # noqa: F401
from .media import FIELD as MULTI_MODAL, media_problem, read_parquet_media

REQUIRED = ("input_ids", "response_mask")
TARGETS = ("returns", "rewards")
OPTIONAL = ("old_values",)
AGENTIC = ("value_mask", "turn_ids")  # optional per-token fields of multi-turn rollouts (and `truncated`, per row)


@dataclasses.dataclass(slots=True)
class Rollouts:
    """A set of rollouts as right-padded [N, T] tensors."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    returns: torch.Tensor | None
    rewards: torch.Tensor | None
    old_values: torch.Tensor | None
    value_mask: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    """bool [N]: rows cut off rather than ended."""
    brought_old_values: bool = False
    """old_values came with the rollouts (else the job fills them in from the critic)."""
    versions: torch.Tensor | None = None
    """int64 [N]: the critic version that computed each row's old values (the data's `version`, or
    the engine's when the job computed them)."""
    multi_modal_inputs: tuple | None = None
    """Per row, a dict of its images' tensors ({} for a text row; common/learning/media.py); None
    when no row has any."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def loss_mask(self) -> torch.Tensor:
        """The tokens the critic regresses: value_mask, or the response."""
        return self.response_mask if self.value_mask is None else self.value_mask

    def select(self, index) -> "Rollouts":
        """Rows `index`, trimmed to their longest sequence."""
        length = int(self.attention_mask[index].sum(dim=1).max()) if len(index) else 0

        def pick(value):
            if isinstance(value, tuple):  # multi_modal_inputs
                picked = tuple(value[int(i)] for i in index)
                return picked if any(picked) else None
            if not isinstance(value, torch.Tensor):
                return value
            return value[index] if value.dim() == 1 else value[index, :length]
        return Rollouts(*(pick(getattr(self, f.name)) for f in dataclasses.fields(self)))


def read_records(path: str) -> list:
    """The rows of a .parquet, .jsonl (one object per line) or .json (an array of objects, or lines) file."""
    if not os.path.isfile(path):
        raise ValueError(f"rollout file {path} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if MULTI_MODAL not in table.column_names:
            return table.to_pylist()
        records = table.drop_columns([MULTI_MODAL]).to_pylist()
        for record, media in zip(records, read_parquet_media(table.column(MULTI_MODAL))):
            record[MULTI_MODAL] = media
        return records
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


PER_TOKEN = ("input_ids", "response_mask") + TARGETS + OPTIONAL + AGENTIC


def validate_records(records: list, vocab_size: int, source: str, *, max_positions: int | None = None,
                     truncate: bool = False, targets: bool = True, off_mask_rewards: str = "error",
                     timestep_unit: str = "token") -> list[str]:
    """Raise one ValueError that names the file, the row and the field of every problem found (each
    kind's first rows shown, the rest counted: summarise_problems).

    Rows longer than `max_positions` tokens are refused, or, with `truncate`, cut to that length in
    place (a cut row with rewards is marked truncated: its returns bootstrap). `targets=False`
    (values only, no training) needs no returns or rewards. A field missing from every row is one
    line. The multi-turn fields (value_mask, turn_ids, truncated) and rewards off the response are
    checked as data.off_mask_rewards and data.timestep_unit will use them. Returns notes worth
    telling the user (rows cut, rows without response tokens).
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
    if off_mask_rewards not in OFF_MASK_REWARDS:
        raise ValueError(f"data.off_mask_rewards={off_mask_rewards!r}: use one of {', '.join(OFF_MASK_REWARDS)}")
    if timestep_unit not in TIMESTEP_UNITS:
        raise ValueError(f"data.timestep_unit={timestep_unit!r}: use one of {', '.join(TIMESTEP_UNITS)}")
    for name in ("old_values", "version", *AGENTIC):
        problems += _all_or_none(records, name)
    if timestep_unit == "turn" and targets and "rewards" in has_target and not any(
            isinstance(r, dict) and r.get("turn_ids") is not None for r in records):
        problems.append("data.timestep_unit=turn needs the field 'turn_ids' in every row (-1 off the response, the "
                        "turn's index on it); give it, or use data.timestep_unit=token")
    truncated = no_response = moved = cut_off = 0
    for row, record in enumerate(records):
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
        per_token = ("response_mask", *has_target[:1],
                     *(f for f in OPTIONAL + AGENTIC if record.get(f) is not None))
        row_problems = [p for p in (_per_token_problem(record[name], name, n) for name in per_token) if p]
        if row_problems:
            problems += [f"row {row}: {p}" for p in row_problems]
            continue
        media, problem = media_problem(record.get(MULTI_MODAL))
        if problem:
            problems.append(f"row {row}: {MULTI_MODAL}: {problem}")
            continue
        if MULTI_MODAL in record:
            record[MULTI_MODAL] = media  # as tensors
        if max_positions is not None and n > max_positions:
            if not truncate:
                problems.append(f"row {row}: input_ids has {n} tokens, more than the model's max_position_embeddings "
                                f"({max_positions}); shorten it, or set data.truncate_to_max_positions=true to cut "
                                f"such rows to {max_positions} tokens")
                continue
            if record.get(MULTI_MODAL):
                problems.append(f"row {row}: input_ids has {n} tokens, more than the model's max_position_embeddings "
                                f"({max_positions}), and it has images: cutting it could part their placeholder "
                                f"tokens from their pixels, so it is not cut; shorten it (fewer or smaller images, "
                                f"a shorter text)")
                continue
            for name in PER_TOKEN:
                if record.get(name) is not None:
                    record[name] = record[name][:max_positions]
            if record.get("rewards") is not None:
                record["truncated"] = True  # cut off, not ended: its returns bootstrap from the critic
            truncated += 1
        mask = record["response_mask"]
        if any(m not in (0, 1) for m in mask):
            problems.append(f"row {row}: response_mask must hold only 0 and 1")
            continue
        if mask[0] == 1:
            problems.append(f"row {row}: response_mask[0] is 1, but the first token has no preceding state to value")
        no_response += not any(mask)
        moved += bool(off_mask_rewards == "previous" and targets and record.get("rewards") is not None
                      and any(r != 0 and not m for r, m in zip(record["rewards"], mask)))
        cut_off += bool(record.get("truncated"))
        for name in per_token[1:]:
            anywhere = name == "rewards"  # a reward off the response is moved, never ignored
            bad = [i for i, (v, m) in enumerate(zip(record[name], mask)) if (m or anywhere) and not math.isfinite(v)]
            if bad:
                problems.append(f"row {row}: {name} is NaN/inf at {'' if anywhere else 'response '}positions {bad[:5]}")
        problems += [f"row {row}: {p}" for p in _agentic_problems(record, mask, off_mask_rewards if targets else None)]
    if not problems and no_response == len(records):
        problems.append("no row has a response token (response_mask is 0 everywhere), so there is nothing to train "
                        "on; mark the response tokens with 1")
    if problems:
        raise ValueError(f"invalid rollouts in {source}: " + summarise_problems(problems))
    if truncated:
        notes.append(f"{source}: cut {truncated} of {len(records)} rollouts to the model's max_position_embeddings "
                     f"({max_positions} tokens; data.truncate_to_max_positions=true)")
    if moved:
        notes.append(f"{source}: {moved} of {len(records)} rollouts have their reward off the response (on a tool "
                     f"output); it goes to the last response token before it (data.off_mask_rewards=previous)")
    if cut_off and "rewards" in has_target:
        notes.append(f"{source}: {cut_off} of {len(records)} rollouts are truncated; their returns bootstrap from the "
                     f"critic's value after their last token, renewed every PPO iteration")
    if no_response:
        notes.append(f"warning: {no_response} of {len(records)} rollouts in {source} have no response tokens "
                     f"(response_mask all 0); they add nothing to training")
    return notes


SHOWN_PER_KIND = 3
"""Rows shown of each kind of problem; the rest of that kind are counted."""


def _problem_kind(problem: str) -> str:
    """A problem's kind: its text without the row and the numbers or lists that vary from row to row."""
    text = re.sub(r"^row \d+: ", "", problem)
    return re.sub(r"\[[^\]]*\]|-?\d+(\.\d+)?", "#", text)


def summarise_problems(problems: list[str]) -> str:
    """Every problem counted, the first SHOWN_PER_KIND of each kind shown in the order found ("... and
    65 more rows with the same problem as row 3"), so a problem of another kind further down is never hidden."""
    kinds: dict[str, list[str]] = {}
    for problem in problems:
        kinds.setdefault(_problem_kind(problem), []).append(problem)
    lines = []
    for same in kinds.values():
        lines += same[:SHOWN_PER_KIND]
        rest = len(same) - SHOWN_PER_KIND
        if rest > 0:
            first = re.match(r"row (\d+):", same[0])
            like = f"row {first.group(1)}" if first else "the first"
            lines.append(f"... and {rest} more {'row' if rest == 1 else 'rows'} with the same problem as {like}")
    head = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"{head} ({len(kinds)} kind{'s' if len(kinds) > 1 else ''}):\n  " + "\n  ".join(lines)


def _all_or_none(records: list, name: str) -> list[str]:
    """A problem when some rows give the optional field `name` and others do not."""
    having = [row for row, r in enumerate(records) if isinstance(r, dict) and r.get(name) is not None]
    if not having or len(having) == len(records):
        return []
    have = set(having)
    without = next(row for row in range(len(records)) if row not in have)
    return [f"row {without}: missing field {name!r} (row {having[0]} has it); give {name} in every row or in none"]


def _agentic_problems(record: dict, mask: list, off_mask_rewards: str | None) -> list[str]:
    """What is wrong with a row's multi-turn fields and off-response rewards (its per-token fields
    already have the right length and are numbers); off_mask_rewards None: rewards unused."""
    problems = []
    value_mask = record.get("value_mask")
    if value_mask is not None:
        if any(v not in (0, 1) for v in value_mask):
            problems.append("value_mask must hold only 0 and 1")
        else:
            outside = [i for i, (v, m) in enumerate(zip(value_mask, mask)) if v and not m]
            if outside:
                problems.append(f"value_mask is 1 at positions {outside[:5]}, outside response_mask: the critic "
                                f"regresses values of response tokens only")
    turn_ids = record.get("turn_ids")
    if turn_ids is not None:
        if any(isinstance(t, float) and not t.is_integer() for t in turn_ids):
            problems.append("turn_ids must be integers")
        else:
            problem = turn_ids_problem([int(t) for t in turn_ids], mask)
            if problem:
                problems.append(problem)
    version = record.get("version")
    if version is not None:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            problems.append(f"version: expected the critic's optimizer step count (an int >= 0) per row, got "
                            f"{_kind(version)}")
        elif record.get("old_values") is None:
            problems.append("version is the version of the critic that computed old_values: give old_values with it")
    truncated = record.get("truncated")
    if truncated is not None:
        if truncated not in (True, False, 0, 1):
            problems.append(f"truncated: expected true or false (per row), got {_kind(truncated)}")
        elif truncated and record.get("returns") is not None:
            problems.append("truncated is true in a row that gives returns: the job bootstraps truncated rows when it "
                            "computes returns from rewards; give rewards, or returns that include your bootstrap")
    rewards = record.get("rewards")
    if rewards is not None and off_mask_rewards is not None and any(mask):  # a row without a response is warned of
        off = [i for i, (r, m) in enumerate(zip(rewards, mask)) if not m and r != 0]
        if off and off_mask_rewards == "error":
            problems.append(f"a non-zero reward ({rewards[off[0]]:g}) at position {off[0]}, outside response_mask (a "
                            f"trajectory that ends on a tool output?); it would be dropped: place it on a response "
                            f"token, or set data.off_mask_rewards=previous to move it to the last response token "
                            f"before it")
        elif off and not any(mask[:off[0]]):
            problems.append(f"a non-zero reward ({rewards[off[0]]:g}) at position {off[0]}, outside response_mask, "
                            f"with no response token before it to move it to (data.off_mask_rewards=previous)")
    return problems


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
    turn_ids = padded("turn_ids", torch.long)
    if turn_ids is not None:
        turn_ids[attention_mask == 0] = -1  # padding is off the response
    truncated = None
    if any(r.get("truncated") is not None for r in records):
        truncated = torch.tensor([bool(r.get("truncated")) for r in records])
    old_values = padded("old_values", torch.float32)
    versions = None
    if records[0].get("version") is not None:
        versions = torch.tensor([int(r["version"]) for r in records], dtype=torch.long)
    media = tuple(r.get(MULTI_MODAL) or {} for r in records)
    return Rollouts(input_ids, attention_mask, padded("response_mask", torch.long), padded("returns", torch.float32),
                    padded("rewards", torch.float32), old_values, value_mask=padded("value_mask", torch.long),
                    turn_ids=turn_ids, truncated=truncated, brought_old_values=old_values is not None,
                    versions=versions, multi_modal_inputs=media if any(media) else None)


def load_rollouts(path: str, vocab_size: int, *, max_positions: int | None = None, truncate: bool = False,
                  notes: list[str] | None = None, **fields) -> Rollouts:
    """Read and validate a rollout file; what validate_records reports is appended to `notes`.
    `fields`: validate_records' off_mask_rewards and timestep_unit."""
    records = read_records(path)
    found = validate_records(records, vocab_size, path, max_positions=max_positions, truncate=truncate, **fields)
    if notes is not None:
        notes += found
    return to_rollouts(records)


def held_out_index(num_rollouts: int, eval_fraction: float, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, held-out rows): a seeded random eval_fraction of the rows held out (at least one
    when eval_fraction > 0)."""
    order = torch.randperm(num_rollouts, generator=torch.Generator().manual_seed(seed))
    count = int(round(num_rollouts * eval_fraction))
    if eval_fraction > 0 and count == 0:
        count = 1
    return order[count:], order[:count]


def split_held_out(rollouts: Rollouts, data, *, seed: int) -> tuple[Rollouts, Rollouts]:
    """(train, held out): held_out_index's split of the rollouts by data.eval_fraction; data is the
    DataConfig. ValueError when either share would be empty."""
    train_rows, held_rows = held_out_index(len(rollouts), data.eval_fraction, seed=seed)
    train, held_out = rollouts.select(train_rows), rollouts.select(held_rows)
    if len(held_out) == 0:
        raise ValueError("data.eval_fraction=0 and no data.eval_path: the held-out evaluation needs rollouts; "
                         "set data.eval_fraction > 0 or give data.eval_path")
    if len(train) == 0:
        raise ValueError(f"{data.train_path} holds {len(rollouts)} rollout(s): holding out "
                         f"data.eval_fraction={data.eval_fraction} of them (at least one) for evaluation leaves "
                         f"none to train on; give more rollouts, or the held-out ones as data.eval_path")
    return train, held_out


def gae_returns(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                gamma: float, lam: float, **multi_turn) -> torch.Tensor:
    """The critic's GAE(gamma, lam) returns alone (gae's second output); `multi_turn`: gae's keywords."""
    return gae(rewards, values, response_mask, gamma, lam, **multi_turn)[1]


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
