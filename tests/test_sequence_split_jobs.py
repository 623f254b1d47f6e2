"""The training job with each sequence split over 2 gloo processes, through each backend's launcher:
Ulysses (`engine.parallel.ulysses=2`) on fsdp and veomni, context parallelism
(`engine.parallel.context=2`) on megatron. The job learns; the run resumed from its step-16 checkpoint
ends with bit-identical weights; resumed from that checkpoint on one process without the split, it
ends where the uninterrupted split run ends (up to float summation order). What a SIGKILL leaves
behind is each backend's kill test's (backends/*/tests/test_training_job.py)."""

import shutil

import pytest
from safetensors.torch import load_file

from critic_adapters.common.tests.helpers import SHORT_JOB, final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import assert_resume_from_a_checkpoint_is_identical, run_launcher

# backend: (the split, the same layout without it)
SPLITS = {"fsdp": (["engine.parallel.ulysses=2"], ["engine.parallel.ulysses=1"]),
          "veomni": (["engine.parallel.ulysses=2"], ["engine.parallel.ulysses=1"]),
          # megatron's default job runs at TP 2: here the two processes split sequences instead.
          "megatron": (["engine.parallel.tensor=1", "engine.parallel.context=2"],
                       ["engine.parallel.tensor=1", "engine.parallel.context=1"])}


def _module(backend: str) -> str:
    return f"critic_adapters.backends.{backend}.train"


@pytest.mark.parametrize("backend", sorted(SPLITS))
def test_the_job_learns_with_split_sequences_and_resumes_identically_and_on_one_process(
        backend, tmp_path):
    split, unsplit = SPLITS[backend]
    args = ("--nproc", "2", *split, *SHORT_JOB)
    one = tmp_path / "one"
    result = assert_resume_from_a_checkpoint_is_identical(_module(backend), tmp_path, *args,
                                                          before_resume=lambda cut: shutil.copytree(cut, one))
    assert "1 data-parallel rank(s), each sequence split over 2 ranks" in result.stdout, result.stdout[:3000]
    assert final_explained_variance(result.stdout) >= 0.5
    resumed = run_launcher(_module(backend), f"trainer.run_dir={one}", *SHORT_JOB, "--nproc", "1", *unsplit, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "each sequence split" not in resumed.stdout
    whole = load_file(str(tmp_path / "whole" / "hf_export" / "model.safetensors"))
    single = load_file(str(one / "hf_export" / "model.safetensors"))
    assert whole.keys() == single.keys()
    worst = max(float((whole[k] - single[k]).abs().max()) for k in whole)
    assert worst <= 1e-4, f"resumed on one process, the weights differ from the split run's by {worst:.3g}"


if __name__ == "__main__":
    run_pytest(__file__)
