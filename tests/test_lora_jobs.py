"""The training job with a LoRA critic (`engine.lora.rank=16`) through each backend's launcher, on 2
gloo processes: the default job learns, and a run killed after a checkpoint resumes to bit-identical
weights (its checkpoints hold only the adapters, the head and their optimizer state)."""

import os

import pytest
from safetensors.torch import load_file

from critic_adapters.common.tests.helpers import SHORT_JOB, final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import assert_killed_run_resumes_identically, run_launcher

BACKENDS = ("fsdp", "megatron", "veomni")  # megatron's default job runs at TP 2, the others at DP 2
LORA = ["engine.lora.rank=16"]
SHORT = SHORT_JOB


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
    assert_killed_run_resumes_identically(_module(backend), tmp_path, "--nproc", "2", *LORA, *SHORT)


if __name__ == "__main__":
    run_pytest(__file__)
