"""Bad rollout files: every problem is reported with the file, the row, the field and what was expected."""

import json

import pytest

from critic_adapters.common.engine.config import load_train_config
from critic_adapters.common.learning.data import load_rollouts, make_default_records
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.job.trainer import read_rollouts

VOCAB, MAX_POSITIONS = 1000, 512


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def refused(path, *fragments, **kwargs):
    with pytest.raises(ValueError) as err:
        load_rollouts(str(path), VOCAB, max_positions=MAX_POSITIONS, **kwargs)
    message = str(err.value)
    for fragment in (str(path), *fragments):
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    return message


def _set(field, index, value):
    return lambda r: r[field].__setitem__(index, value)


@pytest.mark.parametrize("edit,fragments", [
    (_set("input_ids", 3, 100.7), ["row 1: input_ids: expected integer token ids, got float 100.7 at position 3"]),
    (_set("input_ids", 2, "abc"), ["row 1: input_ids: expected integer token ids, got str 'abc' at position 2"]),
    (_set("input_ids", 0, [1, 2]), ["row 1: input_ids: expected integer token ids, got list [1, 2] at position 0"]),
    (lambda r: r.update(input_ids=" ".join(map(str, r["input_ids"]))),
     ["row 1: input_ids: expected a list of integer token ids, got str '"]),
    (lambda r: r.update(input_ids=5), ["row 1: input_ids: expected a list of integer token ids, got int 5"]),
    (lambda r: r.update(response_mask=1), ["row 1: response_mask: expected a list of", "got int 1"]),
    (_set("rewards", 4, "1.0"), ["row 1: rewards: expected numbers, got str '1.0' at position 4"]),
    (_set("rewards", 4, None), ["row 1: rewards: expected numbers, got NoneType None at position 4"]),
])
def test_malformed_fields_name_file_row_field_and_expectation(tmp_path, edit, fragments):
    records = make_default_records(4)
    edit(records[1])
    refused(write_jsonl(tmp_path / "r.jsonl", records), "invalid rollouts in", *fragments)


def test_integral_float_ids_are_token_ids(tmp_path):
    records = make_default_records(3)
    records[0]["input_ids"] = [float(t) for t in records[0]["input_ids"]]  # a Parquet double column
    rollouts = load_rollouts(write_jsonl(tmp_path / "r.jsonl", records), VOCAB)
    assert rollouts.input_ids[0, :3].tolist() == [int(t) for t in records[0]["input_ids"][:3]]


@pytest.mark.parametrize("rows_with,first_without,has_it", [([0], 1, 0), ([0, 1, 3], 2, 0), ([2], 0, 2)])
def test_old_values_in_some_rows_only(tmp_path, rows_with, first_without, has_it):
    records = make_default_records(4)
    for row in rows_with:
        records[row]["old_values"] = [0.0] * len(records[row]["input_ids"])
    refused(write_jsonl(tmp_path / "r.jsonl", records),
            f"row {first_without}: missing field 'old_values' (row {has_it} has it)", "every row or in none")


def test_json_array_file(tmp_path):
    records = make_default_records(4)
    (tmp_path / "good.json").write_text(json.dumps(records, indent=1))
    rollouts = load_rollouts(str(tmp_path / "good.json"), VOCAB)
    assert len(rollouts) == 4 and rollouts.input_ids[2, :5].tolist() == records[2]["input_ids"][:5]
    records[2] = [records[2]]
    (tmp_path / "bad.json").write_text(json.dumps(records))
    refused(tmp_path / "bad.json", "row 2: expected an object with fields input_ids", "got list")
    (tmp_path / "lines.jsonl").write_text(json.dumps(records[:2]) + "\n")
    refused(tmp_path / "lines.jsonl", "row 0: expected an object", "got list")


def test_no_response_tokens_anywhere_is_refused_and_some_is_counted(tmp_path):
    records = make_default_records(8)
    for record in records:
        record["response_mask"] = [0] * len(record["input_ids"])
    refused(write_jsonl(tmp_path / "none.jsonl", records), "no row has a response token")
    records = make_default_records(8)
    for record in records[:3]:
        record["response_mask"] = [0] * len(record["input_ids"])
    notes = []
    load_rollouts(write_jsonl(tmp_path / "some.jsonl", records), VOCAB, notes=notes)
    assert notes == [f"warning: 3 of 8 rollouts in {tmp_path / 'some.jsonl'} have no response tokens "
                     f"(response_mask all 0); they add nothing to training"]


def test_sequences_longer_than_the_model_are_refused_unless_truncation_is_asked_for(tmp_path):
    records = make_default_records(4)
    long = records[2]
    extra = MAX_POSITIONS + 40 - len(long["input_ids"])
    for field, fill in (("input_ids", 7), ("response_mask", 1), ("rewards", 0.0)):
        long[field] = long[field] + [fill] * extra
    path = write_jsonl(tmp_path / "r.jsonl", records)
    refused(path, f"row 2: input_ids has {MAX_POSITIONS + 40} tokens, more than the model's max_position_embeddings "
                  f"({MAX_POSITIONS})", "data.truncate_to_max_positions=true")
    notes = []
    rollouts = load_rollouts(path, VOCAB, max_positions=MAX_POSITIONS, truncate=True, notes=notes)
    assert rollouts.input_ids.shape[1] == MAX_POSITIONS and int(rollouts.attention_mask[2].sum()) == MAX_POSITIONS
    assert notes == [f"{path}: cut 1 of 4 rollouts to the model's max_position_embeddings ({MAX_POSITIONS} tokens; "
                     f"data.truncate_to_max_positions=true)",
                     f"{path}: 1 of 4 rollouts are truncated; their returns bootstrap from the critic's value after "
                     f"their last token, renewed every PPO iteration"]
    # The cut row did not end: its returns bootstrap (issue 42) rather than count the lost tail as 0.
    assert rollouts.truncated.tolist() == [False, False, True, False]


@pytest.mark.parametrize("value, accepted", [(True, True), (0, True), (1, True), (2, False), (0.5, False),
                                             ("yes", False)])
def test_truncated_takes_true_false_and_the_integers_0_and_1_as_docs_data_says(tmp_path, value, accepted):
    records = make_default_records(4, seed=0)
    for record in records:
        record["truncated"] = False
    records[1]["truncated"] = value
    path = write_jsonl(tmp_path / "r.jsonl", records)
    if accepted:
        assert load_rollouts(path, VOCAB, max_positions=MAX_POSITIONS).truncated.tolist()[1] == bool(value)
    else:
        refused(path, "row 1: truncated: expected true or false (per row)")


def test_a_one_row_file_leaves_nothing_to_train_on(tmp_path):
    path = write_jsonl(tmp_path / "one.jsonl", make_default_records(1))
    config = load_train_config([], [f"data.train_path={path}"])
    with pytest.raises(ValueError, match=r"one.jsonl holds 1 rollout\(s\).*data.eval_fraction=0.1.*data.eval_path"):
        read_rollouts(config, VOCAB, MAX_POSITIONS)
    config = load_train_config([], [f"data.train_path={path}", "data.eval_fraction=0"])
    with pytest.raises(ValueError, match="data.eval_fraction=0 and no data.eval_path"):
        read_rollouts(config, VOCAB, MAX_POSITIONS)


if __name__ == "__main__":
    run_pytest(__file__)
