"""The launcher end to end on 2 gloo processes: the default job learns; a killed run resumes to
bit-identical weights; a 2-rank checkpoint resumes on 1 rank."""

import json
import os

from safetensors.torch import load_file

from critic_adapters.backends.fsdp.tests.launch import run_launcher
from critic_adapters.common.metrics import read_metrics
from critic_adapters.common.tests.helpers import (SHORT_JOB, assert_same_exported_weights, final_explained_variance,
                                                   run_pytest)
from critic_adapters.common.tests.torchrun import run_launcher_killed_after

SHORT = SHORT_JOB




def test_default_job_learns_on_two_processes(tmp_path):
    run_dir = tmp_path / "default"
    result = run_launcher("--nproc", "2", f"trainer.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert final_explained_variance(result.stdout) >= 0.5
    train = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    losses = [r["value_loss"] for r in train]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, "value loss did not go down"
    evals = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "eval"]
    assert evals[0]["explained_variance"] < 0.2 < 0.5 <= evals[-1]["explained_variance"]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] >= 0 for r in train)
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert any((run_dir / "tensorboard").iterdir())
    assert json.load(open(run_dir / "hf_export" / "config.json"))["architectures"] == ["Qwen2ForTokenClassification"]


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "hf_export", "model.safetensors"))


def test_killed_run_resumes_to_identical_weights(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    result = run_launcher("--nproc", "2", f"trainer.run_dir={whole}", *SHORT)
    assert result.returncode == 0, result.stderr[-4000:]

    # The same run, its whole process group SIGKILLed once step 8's checkpoint is reported.
    run_launcher_killed_after("critic_adapters.backends.fsdp.train", 8, "--nproc", "2", f"trainer.run_dir={killed}",
                              *SHORT)
    assert not (killed / "hf_export").exists()

    resumed = run_launcher("--nproc", "2", f"trainer.run_dir={killed}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    assert_same_exported_weights(whole, killed)
    assert final_explained_variance(resumed.stdout) == final_explained_variance(result.stdout)


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    run_dir = tmp_path / "run"
    first = run_launcher("--nproc", "2", f"trainer.run_dir={run_dir}", *SHORT[:-4], "trainer.epochs=1",
                         "trainer.export_hf=false", "trainer.progress=false")
    assert first.returncode == 0, first.stderr[-4000:]
    # Continue the same run for a second epoch on a single process.
    resumed = run_launcher("--nproc", "1", f"trainer.run_dir={run_dir}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "at epoch 1" in resumed.stdout
    assert final_explained_variance(resumed.stdout) >= 0.3
    steps = [r["step"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    assert steps == list(range(1, 31)), steps


if __name__ == "__main__":
    run_pytest(__file__)
