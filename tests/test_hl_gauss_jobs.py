"""The training job with an HL-Gauss critic (`engine.loss.kind=hl_gauss`) through each backend's
launcher, on 2 gloo processes: the default job learns (on fsdp; one epoch of it elsewhere); a run resumed from its step-16 checkpoint ends
with bit-identical weights, and resuming it as a scalar (mse) critic is refused naming the key. The
resumed run is a LoRA critic with the HL-Gauss head (engine.lora.rank=16, as tests/test_lora_jobs.py
trains): one resume per backend checks both features' checkpoints (for LoRA, only the adapters, the
head and their optimizer state). What a SIGKILL leaves behind is each backend's kill test's
(backends/*/tests/test_training_job.py)."""

import os
import re

import pytest
import torch

from critic_adapters.common.tests.helpers import SHORT_JOB, final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import (assert_resume_from_a_checkpoint_is_identical, run_launcher,
                                                   run_launcher_in_process)
from critic_adapters.common.valuehead import compute_values, load_critic

BACKENDS = ("fsdp", "megatron", "veomni")  # megatron's default job runs at TP 2, the others at DP 2
# The default data's returns lie in [-1.25, 1.25] (docs/DATA.md: the embedded rollouts).
HL_GAUSS = ["engine.loss.kind=hl_gauss", "engine.loss.clip_range=null", "engine.loss.hl_gauss.min_value=-1.5",
            "engine.loss.hl_gauss.max_value=1.5"]


def _module(backend: str) -> str:
    return f"critic_adapters.backends.{backend}.train"


# The default job's 4 epochs (116 steps) on fsdp, where it must learn; one epoch elsewhere: a backend's
# HL-Gauss update is checked against a single-process reference step in tests/test_hl_gauss.py (every
# backend), and what the job adds to it (the launcher, the trainer, the export) is the same code on every backend.
EPOCHS = {"fsdp": [], "megatron": ["trainer.epochs=1"], "veomni": ["trainer.epochs=1"]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_default_job_learns_with_an_hl_gauss_critic(backend, tmp_path):
    run_dir = tmp_path / "run"
    result = run_launcher(_module(backend), "--nproc", "2", f"trainer.run_dir={run_dir}", *HL_GAUSS,
                          *EPOCHS[backend], "trainer.tensorboard=false", "trainer.progress=false")
    assert result.returncode == 0, result.stderr[-4000:]
    if not EPOCHS[backend]:
        assert final_explained_variance(result.stdout) >= 0.5
    # The export is an HL-Gauss critic of 51 bins whose values (through our loader) are the run's.
    critic, report = load_critic(str(run_dir / "hf_export"))
    assert critic.config.num_labels == 51 and "51 bins over [-1.5, 1.5]" in report.value_head
    ids = torch.tensor([[1, 12, 500, 501, 502, 503]])
    with torch.no_grad():
        values = compute_values(critic, ids, torch.ones_like(ids))
    assert values.shape == (1, 6) and float(values.abs().max()) <= 1.5
    # Issue 27, 4.8: like beside like (a cross-entropy was printed beside an MSE); inspect names the bins.
    assert re.search(r"epoch 1/\d: train cross-entropy [\d.]+, train mse [\d.]+, held-out mse [\d.]+",
                     result.stdout), result.stdout[-2000:]
    inspected = run_launcher_in_process("critic_adapters.common.valuehead.cli", "inspect", str(run_dir / "hf_export"))
    assert "num_labels=51, an HL-Gauss head" in inspected.stdout and "num_labels=1" not in inspected.stdout, \
        inspected.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_hl_gauss_lora_run_resumes_from_a_checkpoint_to_identical_weights(backend, tmp_path):
    args = ("--nproc", "2", *HL_GAUSS, "engine.lora.rank=16", *SHORT_JOB)

    def refuses_resuming_as_mse(run_dir):  # one line naming the key, nothing written
        before = sorted(os.listdir(run_dir / "checkpoints"))
        refused = run_launcher(_module(backend), f"trainer.run_dir={run_dir}", *args, "engine.loss.kind=mse", "--resume")
        assert refused.returncode != 0
        assert "engine.loss.kind: 'hl_gauss' in the run, 'mse' now" in refused.stderr, refused.stderr[-2000:]
        assert sorted(os.listdir(run_dir / "checkpoints")) == before

    result = assert_resume_from_a_checkpoint_is_identical(_module(backend), tmp_path, *args,
                                                          before_resume=refuses_resuming_as_mse if backend == "fsdp" else None)
    assert "parameters: 36,083 trainable of 174,387" in result.stdout, result.stdout[:2000]  # LoRA + a 51-bin head


if __name__ == "__main__":
    run_pytest(__file__)
