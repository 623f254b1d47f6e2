"""Bad input to the launcher: a clear error (exit 2), and nothing lost or half-written. Each launch\nruns in this process (common/tests/torchrun.run_launcher_in_process): every one ends before training."""

import json

import pytest

from critic_adapters.backends.fsdp.tests.launch import launch_in_process as run_launcher
from critic_adapters.common.learning.data import make_default_records
from critic_adapters.common.tests.helpers import run_pytest


def write_jsonl(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def expect_error(result, *fragments):
    assert result.returncode == 2, f"rc={result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr[-3000:]}"


def test_unknown_config_key_suggests_the_right_one(tmp_path):
    expect_error(run_launcher("engine.optim.lrr=1e-4", f"trainer.run_dir={tmp_path}"),
                 "unknown config key 'engine.optim.lrr'", "did you mean engine.optim.lr")
    assert not any(tmp_path.iterdir())


def test_unknown_key_in_a_yaml_file(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("engine:\n  optim:\n    learning_rate: 1.0\n")
    expect_error(run_launcher(str(config), f"trainer.run_dir={tmp_path / 'run'}"), "learning_rate")


@pytest.mark.parametrize("corrupt,message", [
    (lambda r: r.pop("response_mask"), "missing field(s) ['response_mask']"),
    (lambda r: r["input_ids"].__setitem__(3, 5000), "outside the model's vocabulary [0, 1000)"),
    (lambda r: r["rewards"].pop(), "rewards has"),
    (lambda r: r["rewards"].__setitem__(-1, float("nan")), "rewards is NaN/inf"),
])
def test_bad_rollouts(tmp_path, corrupt, message):
    records = make_default_records(8)
    corrupt(records[5])
    path = write_jsonl(tmp_path / "rollouts.jsonl", records)
    result = run_launcher("--dry-run", f"data.train_path={path}", f"trainer.run_dir={tmp_path / 'run'}")
    expect_error(result, "invalid rollouts in", "row 5:", message)


def test_nan_returns(tmp_path):
    records = [{"input_ids": r["input_ids"], "response_mask": r["response_mask"],
                "returns": [1.0] * len(r["input_ids"])} for r in make_default_records(4)]
    records[2]["returns"][-1] = float("nan")
    path = write_jsonl(tmp_path / "rollouts.jsonl", records)
    expect_error(run_launcher("--dry-run", f"data.train_path={path}", f"trainer.run_dir={tmp_path / 'run'}"),
                 "row 2: returns is NaN/inf")


def test_good_rollouts_pass_the_dry_run(tmp_path):
    path = write_jsonl(tmp_path / "rollouts.jsonl", make_default_records(16))
    result = run_launcher("--dry-run", f"data.train_path={path}", f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "config OK" in result.stdout and "causal-lm" in result.stdout


def test_resume_without_a_checkpoint(tmp_path):
    expect_error(run_launcher("--resume", f"trainer.run_dir={tmp_path}"), "--resume: no complete checkpoint in")


def test_existing_run_is_not_overwritten(tmp_path):
    from critic_adapters.common.storage import checkpoints

    step = tmp_path / "checkpoints" / "step_000010"
    step.mkdir(parents=True)
    (step / checkpoints.META_FILE).write_text("{}")
    expect_error(run_launcher(f"trainer.run_dir={tmp_path}"), "already holds checkpoints (step_000010)", "--resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_workers_are_forked_only_where_a_forked_rank_is_sound(monkeypatch):
    import torch

    from critic_adapters.common.job.forked_workers import WORKER_START_ENV
    from critic_adapters.common.job.forked_workers import start_method as worker_start_method

    monkeypatch.delenv(WORKER_START_ENV, raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_start_method(1) == "fork"
    assert worker_start_method(2) == "spawn"  # OpenMP's pool does not survive a fork
    monkeypatch.setenv(WORKER_START_ENV, "spawn")
    assert worker_start_method(1) == "spawn"
    monkeypatch.setenv(WORKER_START_ENV, "forkserver")
    with pytest.raises(ValueError, match="CRITIC_ADAPTERS_WORKER_START=forkserver: expected auto"):
        worker_start_method(1)
    monkeypatch.setenv(WORKER_START_ENV, "auto")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # a rank would inherit the group
    assert worker_start_method(1) == "spawn"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CUDA does not survive a fork
    assert worker_start_method(1) == "spawn"


if __name__ == "__main__":
    run_pytest(__file__)
