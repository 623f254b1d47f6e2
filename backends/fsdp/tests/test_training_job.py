"""The launcher end to end on 2 gloo processes: the job learns; the same run killed after a
checkpoint resumes to bit-identical weights, and on 1 rank it continues the same loss curve."""

import json
import shutil

import pytest

from critic_adapters.backends.fsdp.tests.launch import LAUNCHER, run_launcher
from critic_adapters.common.job.metrics import read_metrics
from critic_adapters.common.tests.helpers import SHORT_JOB, final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import assert_killed_run_resumes_identically, assert_resumed_run_follows

SHORT = SHORT_JOB


def test_the_job_learns_and_a_killed_run_resumes_identically_on_two_ranks_and_on_one(tmp_path):
    one = tmp_path / "one-rank"
    whole = assert_killed_run_resumes_identically(
        LAUNCHER, tmp_path, "--nproc", "2", *SHORT, whole_args=("trainer.tensorboard=true", "trainer.plot=true"),
        before_resume=lambda killed: shutil.copytree(killed, one))
    # It learns.
    run_dir = tmp_path / "whole"
    assert final_explained_variance(whole.stdout) >= 0.5
    train = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    losses = [r["value_loss"] for r in train]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, "value loss did not go down"
    evals = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "eval"]
    assert evals[0]["explained_variance"] < 0.2 < 0.5 <= evals[-1]["explained_variance"]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] >= 0 for r in train)
    # Telemetry (docs/METRICS.md; common/tests/test_telemetry.py checks the numbers): on every row.
    assert all(0 < r["mfu"] < 1 and r["time/update_s"] > 0 and r["memory/peak_bytes"] > 2**20 for r in train)
    assert all(r["return/std"] > 0 and r["value/std"] >= 0 for r in train)
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert any((run_dir / "tensorboard").iterdir())
    assert json.load(open(run_dir / "hf_export" / "config.json"))["architectures"] == ["Qwen2ForTokenClassification"]
    # The 2-rank checkpoint of step 16, continued on a single process.
    resumed = run_launcher("--nproc", "1", f"trainer.run_dir={one}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "over 1 data-parallel rank(s)" in resumed.stdout
    assert_resumed_run_follows(one, run_dir, steps=30)


def _far_returns_file(path, *, old_values: bool) -> str:
    """Rollouts whose every return is 3.0, far beyond one value clip (0.5) from the initial critic's
    values (near 0); with old_values, those are 0.0 (a rollout-time critic that predicted 0)."""
    from critic_adapters.common.learning.data import make_default_records

    with open(path, "w") as f:
        for record in make_default_records(128, seed=0):
            row = {"input_ids": record["input_ids"], "response_mask": record["response_mask"],
                   "returns": [3.0] * len(record["input_ids"])}
            if old_values:
                row["old_values"] = [0.0] * len(record["input_ids"])
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.mark.parametrize("old_values", [False, True], ids=["no-old-values", "old-values-given"])
def test_the_value_clip_bounds_a_ppo_iteration_not_the_whole_run(tmp_path, old_values):
    # 1 epoch of 8 steps, a PPO iteration every 2 (32 rollouts): without old values the clip's centre
    # follows the critic, which can go the whole way to the returns; old values given in the data
    # stay the centre, and the clip holds every value within 0.5 of them all run long.
    run_dir = tmp_path / "run"
    result = run_launcher(
        "--nproc", "1", f"data.train_path={_far_returns_file(tmp_path / 'far.jsonl', old_values=old_values)}",
        "data.mini_batch_size=16", "data.rollout_batch_size=32", "trainer.epochs=1", "engine.optim.lr=1e-2",
        "engine.optim.warmup_ratio=0", "trainer.export_hf=false", f"trainer.run_dir={run_dir}", *SHORT[-3:])
    assert result.returncode == 0, result.stderr[-4000:]
    held_out = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "eval"][-1]
    rmse = (2 * held_out["value_loss"]) ** 0.5  # the values' distance from the returns (3.0); about 3 at the start
    if old_values:  # held near the clip around 0 (Adam's momentum carries them a little past it): far from 3
        assert rmse >= 1.0, f"values went the whole way despite the clip around the data's old values (rmse {rmse})"
    else:  # measured 0.14 (1.6 with the old values given)
        assert rmse <= 0.5, f"the critic is still capped near its initial values (rmse {rmse} from the returns)"


if __name__ == "__main__":
    run_pytest(__file__)
