"""The training job with a LoRA critic (`engine.lora.rank=16`) through each backend's launcher, on 2
gloo processes: the default job learns, and a run killed after a checkpoint resumes to bit-identical
weights (its checkpoints hold only the adapters, the head and their optimizer state)."""

import os

import pytest
from safetensors.torch import load_file

from critic_adapters.common.tests.helpers import final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import run_launcher, run_launcher_killed_after

BACKENDS = ("fsdp", "megatron", "veomni")  # megatron's default job runs at TP 2, the others at DP 2
LORA = ["engine.lora.rank=16"]
# A shorter job than the default: 512 rollouts, 2 epochs of 15 steps.
SHORT = ["data.num_rollouts=512", "data.mini_batch_size=32", "trainer.epochs=2", "trainer.save_every_steps=4",
         "trainer.keep_last=3", "trainer.tensorboard=false", "trainer.plot=false", "trainer.progress=false"]


def _module(backend: str) -> str:
    return f"critic_adapters.backends.{backend}.train"


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "hf_export", "model.safetensors"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_default_job_learns_with_a_lora_critic(backend, tmp_path):
    result = run_launcher(_module(backend), "--nproc", "2", f"trainer.run_dir={tmp_path / 'run'}", *LORA,
                          "trainer.tensorboard=false", "trainer.progress=false")
    assert result.returncode == 0, result.stderr[-4000:]
    counts = [line for line in result.stdout.splitlines() if line.startswith("parameters: ")]
    assert counts == ["parameters: 32,833 trainable of 171,137 (19.19%)"], counts  # the same critic everywhere
    assert final_explained_variance(result.stdout) >= 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_lora_run_resumes_to_identical_weights(backend, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    result = run_launcher(_module(backend), "--nproc", "2", f"trainer.run_dir={whole}", *LORA, *SHORT)
    assert result.returncode == 0, result.stderr[-4000:]

    run_launcher_killed_after(_module(backend), 8, "--nproc", "2", f"trainer.run_dir={killed}", *LORA, *SHORT)

    resumed = run_launcher(_module(backend), "--nproc", "2", f"trainer.run_dir={killed}", *LORA, *SHORT, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys()
    different = [k for k in a if not (a[k] == b[k]).all()]
    assert not different, f"resumed weights differ from the uninterrupted run in {different}"
    assert final_explained_variance(resumed.stdout) == final_explained_variance(result.stdout)


if __name__ == "__main__":
    run_pytest(__file__)
