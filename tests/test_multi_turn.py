"""Issue 42: multi-turn rollouts through the job. Bad multi-turn fields are refused with the row named
before anything is written; a job on agent trajectories (rewards on trailing tool outputs moved,
truncated rows bootstrapped, turn-level GAE, a value mask of turn anchors) learns and resumes bit for
bit from inside a PPO iteration whose returns it renewed. (The GAE rules: common/tests/test_gae.py;
the value mask on every backend: tests/conformance.)"""

from __future__ import annotations

import json

import pytest

from critic_adapters.common.job.metrics import read_metrics
from critic_adapters.common.learning.multi_turn import make_multi_turn_records
from critic_adapters.common.tests.helpers import SHORT_JOB, final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import (assert_resume_from_a_checkpoint_is_identical, run_launcher,
                                                   run_launcher_in_process as launch)

FSDP = "critic_adapters.backends.fsdp.train"


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def turn_anchors(record: dict) -> list[int]:
    """1 on the first action token of each turn (VAGEN's anchors): the value mask of turn-level GAE."""
    ids = record["turn_ids"]
    return [int(t >= 0 and (p == 0 or ids[p - 1] != t)) for p, t in enumerate(ids)]


def _ends_on_tool(records) -> dict:
    return next(r for r in records if not r["truncated"] and not r["response_mask"][-1])


def _reward_before_any_response(records):
    records[0]["rewards"][1] = 1.0


def _value_mask_on_a_tool_token(records):
    for record in records:
        record["value_mask"] = list(record["response_mask"])
    record = _ends_on_tool(records)
    record["value_mask"][-1] = 1


def _turn_ids_going_down(records):
    ids = records[0]["turn_ids"]
    ids[len(ids) - 1 - records[0]["response_mask"][::-1].index(1)] = 0  # the last action token back in turn 0


def _turn_id_on_a_tool_token(records):
    _ends_on_tool(records)["turn_ids"][-1] = 3


def _truncated_with_returns(records):
    for record in records:
        record["returns"] = record.pop("rewards")


def _value_mask_in_one_row(records):
    records[3]["value_mask"] = list(records[3]["response_mask"])


BAD = {  # name: (change to the embedded records, extra keys, what the refusal says)
    "reward-on-a-tool-output": (None, [], "outside response_mask (a trajectory that ends on a tool output?); it would "
                                        "be dropped: place it on a response token, or set data.off_mask_rewards=previous"),
    "reward-before-any-response": (_reward_before_any_response, ["data.off_mask_rewards=previous"],
                                   "row 0: a non-zero reward (1) at position 1, outside response_mask, with no response "
                                   "token before it"),
    "value-mask-on-a-tool-token": (_value_mask_on_a_tool_token, ["data.off_mask_rewards=previous"],
                                   "value_mask is 1 at positions"),
    "turn-ids-going-down": (_turn_ids_going_down, ["data.off_mask_rewards=previous"],
                            "row 0: turn ids decrease at position"),
    "turn-id-on-a-tool-token": (_turn_id_on_a_tool_token, ["data.off_mask_rewards=previous"],
                                "off the response (tokens off the response take -1)"),
    "truncated-with-returns": (_truncated_with_returns, [], "truncated is true in a row that gives returns"),
    "turn-mode-without-turn-ids": (lambda records: [r.pop("turn_ids") for r in records],
                                   ["data.off_mask_rewards=previous", "data.timestep_unit=turn"],
                                   "data.timestep_unit=turn needs the field 'turn_ids' in every row"),
    "version-without-old-values": (lambda records: [r.update(version=3) for r in records],
                                   ["data.off_mask_rewards=previous"],
                                   "version is the version of the critic that computed old_values: give old_values"),
    "value-mask-in-one-row": (_value_mask_in_one_row, ["data.off_mask_rewards=previous"],
                              "row 0: missing field 'value_mask' (row 3 has it); give value_mask in every row or in none"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_multi_turn_fields_are_refused_naming_the_row_before_anything_is_written(tmp_path, case):
    change, keys, message = BAD[case]
    records = make_multi_turn_records(64, seed=0)
    if change is not None:
        change(records)
    path = write_jsonl(tmp_path / "rollouts.jsonl", records)
    run_dir = tmp_path / "run"
    dry = launch(FSDP, "--dry-run", f"data.train_path={path}", *keys, f"trainer.run_dir={run_dir}")
    assert dry.returncode == 2 and message in dry.stderr, dry.stderr[-3000:]
    assert "row " in dry.stderr and not run_dir.exists()


def test_every_problem_is_counted_and_each_kind_shown(tmp_path):
    """issue 49: the rows with a reward on a tool output are all counted (the first few shown), and a
    problem of another kind in the last row is shown too, through the dry run."""
    records = make_multi_turn_records(64, seed=0)
    off_mask = [row for row, r in enumerate(records) if not r["truncated"] and not r["response_mask"][-1]]
    records[-1]["input_ids"][0] = 5000  # outside the tiny model's vocabulary of 1000
    path = write_jsonl(tmp_path / "rollouts.jsonl", records)
    dry = launch(FSDP, "--dry-run", f"data.train_path={path}", f"trainer.run_dir={tmp_path / 'run'}")
    shown = dry.stderr.count("outside response_mask (a trajectory that ends on a tool output?)")
    assert dry.returncode == 2 and len(off_mask) > 3 and shown == 3, (off_mask, dry.stderr[-3000:])
    assert (f"... and {len(off_mask) - 3} more rows with the same problem as row {off_mask[0]}") in dry.stderr
    assert f"{len(off_mask) + 1} problems (2 kinds)" in dry.stderr, dry.stderr[-3000:]
    assert "row 63: token ids [5000] are outside the model's vocabulary" in dry.stderr, dry.stderr[-3000:]


def test_the_embedded_set_is_refused_without_a_placement_and_a_launch_writes_nothing(tmp_path):
    """The embedded multi-turn rollouts end on tool outputs with the reward there, as agent loops record
    them: a launch without data.off_mask_rewards=previous refuses them in its worker, before it writes."""
    result = run_launcher(FSDP, "data.train_path=embedded:multi_turn", "data.num_rollouts=64",
                          f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode != 0 and "invalid rollouts in embedded:multi_turn" in result.stderr, result.stderr[-3000:]
    assert "set data.off_mask_rewards=previous" in result.stderr
    assert not (tmp_path / "run").exists()
    # With it, the dry run says what happens to those rewards and to the truncated rows.
    dry = launch(FSDP, "--dry-run", "data.train_path=embedded:multi_turn", "data.num_rollouts=64",
                 "data.off_mask_rewards=previous", f"trainer.run_dir={tmp_path / 'run'}")
    records = make_multi_turn_records(64, seed=0)
    moved = sum(1 for r in records if not r["truncated"] and not r["response_mask"][-1])
    cut = sum(1 for r in records if r["truncated"])
    assert dry.returncode == 0 and 0 < moved and 0 < cut, dry.stderr[-3000:]
    assert (f"{moved} of 64 rollouts have their reward off the response (on a tool output); it goes to the last "
            f"response token before it") in dry.stdout, dry.stdout
    assert f"{cut} of 64 rollouts are truncated; their returns bootstrap" in dry.stdout, dry.stdout


def test_a_turn_level_job_on_agent_trajectories_learns_and_resumes_inside_an_iteration_bit_identically(tmp_path):
    """Turn-level GAE, truncated rows bootstrapped from the critic (returns renewed every PPO iteration of
    3 mini-batches: the checkpoint of step 16 is inside one, so it must carry that iteration's returns
    and old values), rewards on trailing tool outputs moved, the critic trained on turn anchors only."""
    records = make_multi_turn_records(512, seed=0)
    for record in records:
        record["value_mask"] = turn_anchors(record)
    path = write_jsonl(tmp_path / "anchors.jsonl", records)
    args = [f"data.train_path={path}", "data.off_mask_rewards=previous", "data.timestep_unit=turn",
            "data.rollout_batch_size=96", *SHORT_JOB]
    whole = assert_resume_from_a_checkpoint_is_identical(FSDP, tmp_path, *args)
    rows = read_metrics(str(tmp_path / "whole" / "metrics.jsonl"))
    evals = [row["explained_variance"] for row in rows if row["split"] == "eval"]
    # A short job (30 steps, ~3 anchors a row): it learns; the default job's figures are in PERFORMANCE.md.
    assert evals[0] < 0.2 < 0.4 <= evals[-1] == pytest.approx(final_explained_variance(whole.stdout), abs=1e-4), evals
    train = [row for row in rows if row["split"] == "train"]
    # The loss counted the anchors alone: at most 4 turns per row of a 32-row mini-batch (the action
    # tokens are 8 or more per row).
    assert all(0 < row["valid_tokens"] <= 4 * 32 for row in train), [row["valid_tokens"] for row in train]
    # Issue 44, 3: the old values' staleness, in critic steps: renewed at each iteration's first step;
    # the resumed run (from step 16, inside an iteration) goes on with the same numbers.
    assert [row["old_values/staleness_max"] for row in train[:9]] == [0, 1, 2] * 3, train[:9]
    resumed = [row for row in read_metrics(str(tmp_path / "resumed" / "metrics.jsonl")) if row["split"] == "train"]
    keys = ("value_loss", "grad_norm", "old_values/staleness_mean", "old_values/staleness_max")
    assert [[row[k] for k in keys] for row in resumed if row["step"] > 16] == \
           [[row[k] for k in keys] for row in train if row["step"] > 16]


if __name__ == "__main__":
    run_pytest(__file__)
