"""The VeOmni launcher end to end on 2 gloo processes: the default job learns; a killed run resumes to
bit-identical weights; a 2-rank run's checkpoint resumes on 1 rank; bf16 mixed precision with
gradient checkpointing trains."""

import json
import os

from safetensors.torch import load_file

from critic_adapters.backends.veomni.tests.launch import LAUNCHER, run_launcher
from critic_adapters.common.metrics import read_metrics
from critic_adapters.common.tests.helpers import SHORT_JOB, assert_same_exported_weights, run_pytest
from critic_adapters.common.tests.torchrun import run_launcher_killed_after

SHORT = SHORT_JOB


def final_ev(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("final explained_variance="), last
    return float(last.split("=", 1)[1])


def test_default_job_learns_on_two_processes(tmp_path):
    run_dir = tmp_path / "default"
    result = run_launcher("--nproc", "2", f"trainer.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert final_ev(result.stdout) >= 0.5
    train = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    losses = [r["value_loss"] for r in train]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, "value loss did not go down"
    evals = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "eval"]
    assert evals[0]["explained_variance"] < 0.2 < 0.5 <= evals[-1]["explained_variance"]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] >= 0 for r in train)
    assert json.load(open(run_dir / "hf_export" / "config.json"))["architectures"] == ["Qwen2ForTokenClassification"]
    assert json.load(open(run_dir / "checkpoints" / "step_000116" / "critic_checkpoint.json"))["backend"] == "veomni"


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "hf_export", "model.safetensors"))


def test_killed_run_resumes_to_identical_weights(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    result = run_launcher("--nproc", "2", f"trainer.run_dir={whole}", *SHORT)
    assert result.returncode == 0, result.stderr[-4000:]

    # The same run, its whole process group SIGKILLed once step 8's checkpoint is reported.
    run_launcher_killed_after(LAUNCHER, 8, "--nproc", "2", f"trainer.run_dir={killed}", *SHORT)
    assert not (killed / "hf_export").exists()

    resumed = run_launcher("--nproc", "2", f"trainer.run_dir={killed}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    assert_same_exported_weights(whole, killed)
    assert final_ev(resumed.stdout) == final_ev(result.stdout)


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    run_dir = tmp_path / "run"
    first = run_launcher("--nproc", "2", f"trainer.run_dir={run_dir}", *SHORT[:-4], "trainer.epochs=1",
                         "trainer.export_hf=false", "trainer.progress=false")
    assert first.returncode == 0, first.stderr[-4000:]
    resumed = run_launcher("--nproc", "1", f"trainer.run_dir={run_dir}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "at epoch 1" in resumed.stdout
    assert final_ev(resumed.stdout) >= 0.3
    steps = [r["step"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    assert steps == list(range(1, 31)), steps


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
