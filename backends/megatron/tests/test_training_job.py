"""The megatron launcher end to end on 2 gloo processes as one tensor-parallel pair: the job learns;
the same run killed after a checkpoint resumes to bit-identical weights, and at TP1 it continues the
same loss curve; process counts the layout cannot use are refused."""

import json
import os
import shutil
import subprocess
import sys

from safetensors.torch import load_file

from critic_adapters.backends.megatron.tests.launch import worker_env
from critic_adapters.common.job.metrics import read_metrics
from critic_adapters.common.storage.checkpoints import META_FILE
from critic_adapters.common.tests.helpers import (SHORT_JOB, assert_same_exported_weights, final_explained_variance,
                                                   run_pytest)
from critic_adapters.common.tests.torchrun import (KILL_AFTER_STEP, assert_resumed_run_follows,
                                                   run_launcher_in_process, run_launcher_killed_after)

MODULE = "critic_adapters.backends.megatron.train"
SHORT = SHORT_JOB


def launch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", MODULE, *args], env=worker_env(), capture_output=True, text=True,
                          timeout=timeout)




def test_process_counts_the_layout_cannot_use_are_refused_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "refused"
    for nproc, message in (("3", "3 processes cannot be split into groups of engine.parallel tensor x pipeline"),
                           ("0", "--nproc 0: the process count must be >= 1")):
        result = run_launcher_in_process(MODULE, "--nproc", nproc, f"trainer.run_dir={run_dir}")
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert not run_dir.exists()


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "hf_export", "model.safetensors"))


def _killed_mid_run(run_dir) -> None:
    run_launcher_killed_after(MODULE, KILL_AFTER_STEP, "--nproc", "2", f"trainer.run_dir={run_dir}", *SHORT)


def test_the_job_learns_and_a_killed_run_resumes_identically_and_at_another_tensor_degree(tmp_path):
    whole = tmp_path / "whole"
    result = launch(f"trainer.run_dir={whole}", *SHORT)  # no --nproc: the layout (TP 2) needs 2 processes
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines()[0].startswith("starting 2 processes, the engine.parallel layout's"), result.stdout
    assert "over 1 data-parallel rank(s)" in result.stdout  # 2 processes, one TP pair
    # The precision default said, and recorded resolved: bf16 on CUDA, fp32 here on CPU (issue 49).
    assert "precision: fp32 (engine.mixed_precision=auto on cpu; auto is bf16 on CUDA" in result.stdout, result.stdout
    assert "  mixed_precision: none\n" in (whole / "config.yaml").read_text()
    assert final_explained_variance(result.stdout) >= 0.5
    losses = [r["value_loss"] for r in read_metrics(str(whole / "metrics.jsonl")) if r["split"] == "train"]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, "value loss did not go down"

    same, other = tmp_path / "same-layout", tmp_path / "tp1"
    _killed_mid_run(same)
    shutil.copytree(same, other)  # the same killed run, resumed twice
    resumed = launch("--nproc", "2", f"trainer.run_dir={same}", *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_exported_weights(whole, same)

    # The same checkpoint, continued by one process at TP1: the loss curve goes on where it was.
    resumed = launch("--nproc", "1", f"trainer.run_dir={other}", *SHORT, "engine.parallel.tensor=1", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_resumed_run_follows(other, whole, steps=30)


def test_a_run_saved_before_the_optimizer_was_recorded_resumes_only_with_the_plain_optimizer(tmp_path):
    """A run written before engine.optim.distributed_optimizer existed (its config.yaml and checkpoint
    meta do not name it; it ran megatron's plain optimizer on CPU) is refused by the default, the
    distributed optimizer, naming the key, and resumes with engine.optim.distributed_optimizer=false."""
    run_dir = tmp_path / "old"
    small = (f"trainer.run_dir={run_dir}", "--nproc", "1", "engine.parallel.tensor=1", "data.num_rollouts=32",
             "data.mini_batch_size=16", "trainer.save_every_steps=1", "trainer.export_hf=false", "trainer.plot=false",
             "trainer.tensorboard=false", "trainer.progress=false")
    result = launch(*small, "trainer.epochs=1", "engine.optim.distributed_optimizer=false")
    assert result.returncode == 0, result.stderr[-4000:]
    config = (run_dir / "config.yaml").read_text()
    assert "distributed_optimizer: false" in config
    (run_dir / "config.yaml").write_text(config.replace("    distributed_optimizer: false\n", ""))
    for meta_file in run_dir.glob(f"checkpoints/step_*/{META_FILE}"):
        meta = json.loads(meta_file.read_text())
        assert meta.pop("distributed_optimizer") is False
        meta_file.write_text(json.dumps(meta))

    refused = launch(*small, "trainer.epochs=2", "--resume")
    assert refused.returncode != 0
    assert "holds the state of the plain (replicated) optimizer" in refused.stderr, refused.stderr[-4000:]
    assert "resume it with engine.optim.distributed_optimizer=false" in refused.stderr, refused.stderr[-4000:]
    resumed = launch(*small, "trainer.epochs=2", "engine.optim.distributed_optimizer=false", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resume: engine.optim.distributed_optimizer changed from True to False" in resumed.stdout, resumed.stdout


if __name__ == "__main__":
    run_pytest(__file__)
