"""The training job with a LoRA critic (`engine.lora.rank=16`) through each backend's launcher, on 2
gloo processes: the default job learns. That a killed LoRA run resumes to bit-identical weights (its
checkpoints hold only the adapters, the head and their optimizer state) is checked together with
HL-Gauss's, on a LoRA critic with an HL-Gauss head (tests/test_hl_gauss_jobs.py): one killed run
per backend for both."""

import os

import pytest
from safetensors.torch import load_file

from critic_adapters.common.tests.helpers import final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import run_launcher

BACKENDS = ("fsdp", "megatron", "veomni")  # megatron's default job runs at TP 2, the others at DP 2
LORA = ["engine.lora.rank=16"]


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


if __name__ == "__main__":
    run_pytest(__file__)
