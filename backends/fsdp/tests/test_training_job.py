"""The launcher end to end on 2 gloo processes: the job learns; the same run killed after a
checkpoint resumes to bit-identical weights, and on 1 rank it continues the same loss curve."""

import json
import shutil

from critic_adapters.backends.fsdp.tests.launch import LAUNCHER, run_launcher
from critic_adapters.common.metrics import read_metrics
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
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert any((run_dir / "tensorboard").iterdir())
    assert json.load(open(run_dir / "hf_export" / "config.json"))["architectures"] == ["Qwen2ForTokenClassification"]
    # The 2-rank checkpoint of step 8, continued on a single process.
    resumed = run_launcher("--nproc", "1", f"trainer.run_dir={one}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "over 1 data-parallel rank(s)" in resumed.stdout
    assert_resumed_run_follows(one, run_dir, steps=30)


if __name__ == "__main__":
    run_pytest(__file__)
