"""The training job with a LoRA critic (`engine.lora.rank=16`) through each backend's launcher, on 2
gloo processes: the default job learns (on fsdp; one epoch of it elsewhere). That a LoRA run resumes to bit-identical weights (its
checkpoints hold only the adapters, the head and their optimizer state) is checked together with
HL-Gauss's, on a LoRA critic with an HL-Gauss head (tests/test_hl_gauss_jobs.py): one resumed run
per backend for both."""

import os

import pytest
import torch
from safetensors.torch import load_file

from critic_adapters.common.tests.helpers import final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import run_launcher
from critic_adapters.common.valuehead import compute_values, load_critic

BACKENDS = ("fsdp", "megatron", "veomni")  # megatron's default job runs at TP 2, the others at DP 2
LORA = ["engine.lora.rank=16"]


def _module(backend: str) -> str:
    return f"critic_adapters.backends.{backend}.train"


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "hf_export", "model.safetensors"))


# The default job's 4 epochs (116 steps) on fsdp, where it must learn; one epoch elsewhere: a backend's LoRA
# update is checked against peft's own step in tests/test_lora.py (every backend), and what the job adds to
# it (the launcher, the trainer, the exports) is the same code on every backend.
EPOCHS = {"fsdp": [], "megatron": ["trainer.epochs=1"], "veomni": ["trainer.epochs=1"]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_default_job_learns_with_a_lora_critic(backend, tmp_path):
    result = run_launcher(_module(backend), "--nproc", "2", f"trainer.run_dir={tmp_path / 'run'}", *LORA,
                          *EPOCHS[backend], "trainer.tensorboard=false", "trainer.progress=false")
    assert result.returncode == 0, result.stderr[-4000:]
    counts = [line for line in result.stdout.splitlines() if line.startswith("parameters: ")]
    assert counts == ["parameters: 32,833 trainable of 171,137 (19.19%)"], counts  # the same critic everywhere
    if not EPOCHS[backend]:
        assert final_explained_variance(result.stdout) >= 0.5
    # Issue 27, 4.7: the run says it is a LoRA run, and writes the adapter beside the merged critic.
    assert "LoRA rank 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in result.stdout
    run_dir = tmp_path / "run"
    merged, _ = load_critic(str(run_dir / "hf_export"))
    adapted, _ = load_critic(str(run_dir / "embedded-qwen2"), adapter_path=str(run_dir / "hf_export_adapter"))
    ids = torch.tensor([[1, 12, 500, 501, 502, 503]])
    with torch.no_grad():
        diff = (compute_values(merged, ids, torch.ones_like(ids)) - compute_values(adapted, ids, torch.ones_like(ids)))
    assert float(diff.abs().max()) <= 1e-5, "the adapter on its base is not the merged critic"


if __name__ == "__main__":
    run_pytest(__file__)
