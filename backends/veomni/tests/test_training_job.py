"""The VeOmni launcher end to end on 2 gloo processes: the job learns; the same run killed after a
checkpoint resumes to bit-identical weights, and on 1 rank it continues the same loss curve; bf16
mixed precision with gradient checkpointing trains."""

import json
import shutil

from critic_adapters.backends.veomni.tests.launch import LAUNCHER, run_launcher
from critic_adapters.common.job.metrics import read_metrics
from critic_adapters.common.tests.helpers import SHORT_JOB, run_pytest
from critic_adapters.common.tests.torchrun import assert_killed_run_resumes_identically, assert_resumed_run_follows

SHORT = SHORT_JOB


def final_ev(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("final explained_variance="), last
    return float(last.split("=", 1)[1])


def test_the_job_learns_and_a_killed_run_resumes_identically_on_two_ranks_and_on_one(tmp_path):
    one = tmp_path / "one-rank"
    whole = assert_killed_run_resumes_identically(LAUNCHER, tmp_path, "--nproc", "2", *SHORT,
                                                  before_resume=lambda killed: shutil.copytree(killed, one))
    run_dir = tmp_path / "whole"
    assert final_ev(whole.stdout) >= 0.5
    losses = [r["value_loss"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, "value loss did not go down"
    assert json.load(open(run_dir / "hf_export" / "config.json"))["architectures"] == ["Qwen2ForTokenClassification"]
    # The 2-rank checkpoint of step 16, continued on a single process.
    resumed = run_launcher("--nproc", "1", f"trainer.run_dir={one}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "over 1 data-parallel rank(s)" in resumed.stdout
    assert_resumed_run_follows(one, run_dir, steps=30)


def test_bf16_mixed_precision_and_gradient_checkpointing_train(tmp_path):
    """VeOmni's FSDP2 mixed-precision policy (bf16 compute, fp32 reduce) with activation recompute."""
    run_dir = tmp_path / "bf16"
    result = run_launcher("--nproc", "2", f"trainer.run_dir={run_dir}", *SHORT, "engine.mixed_precision=bf16",
                          "engine.gradient_checkpointing=true", "trainer.export_hf=false")
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [r["value_loss"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, "value loss did not go down"
    assert final_ev(result.stdout) >= 0.3


if __name__ == "__main__":
    run_pytest(__file__)
