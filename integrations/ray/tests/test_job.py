"""The training job on Ray (python -m critic_adapters.integrations.ray.train, 2 actors on a local
cluster it starts itself): the job learns, and the same run killed after a checkpoint resumes to
bit-identical weights; the example PPO loop's critic learns."""

import os
import re
import subprocess
import sys

from critic_adapters.common.tests.helpers import (SHORT_JOB, final_explained_variance,
                                                   run_pytest)
from critic_adapters.common.tests.torchrun import assert_killed_run_resumes_identically, worker_env

MODULE = "critic_adapters.integrations.ray.train"
SHORT = SHORT_JOB


def ray_env(tmp_path) -> dict:
    # Token authentication off in this test's own environment (and its ~/.ray in tmp_path).
    return worker_env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))


def test_the_job_learns_on_a_ray_group_and_a_killed_run_resumes_to_identical_weights(tmp_path):
    # --nproc: the one launcher's flag (--num-workers is the same flag).
    result = assert_killed_run_resumes_identically(MODULE, tmp_path, "--nproc", "2", *SHORT, env=ray_env(tmp_path))
    assert "starting 2 Ray worker(s)" in result.stdout
    assert "over 2 data-parallel rank(s)" in result.stdout
    assert final_explained_variance(result.stdout) >= 0.5


def test_more_workers_than_the_cluster_can_hold_is_refused_at_once_and_writes_nothing(tmp_path):
    # Issue 27, 4.1: the placement group waited forever, silently, and run_dir was written.
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", MODULE, "--num-workers", "64", f"trainer.run_dir={run_dir}"],
                            env=ray_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(r"error: 64 workers of 1 CPU asked, the cluster has \d+ CPU in all", result.stderr), result.stderr
    assert "starting 64 Ray worker(s)" not in result.stdout and not run_dir.exists()

def test_the_example_ppo_loop_runs_and_its_critic_learns(tmp_path):
    import critic_adapters

    example = os.path.join(os.path.dirname(critic_adapters.__file__), "examples", "ppo_critic_with_ray.py")
    result = subprocess.run([sys.executable, example, "--out", str(tmp_path / "out")], env=ray_env(tmp_path),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    variance = [float(v) for v in re.findall(r"explained variance of the returns (-?[\d.]+)", result.stdout)]
    assert len(variance) == 3 and variance[-1] > max(0.5, variance[0]), result.stdout
    assert (tmp_path / "out" / "hf_export" / "config.json").is_file()


if __name__ == "__main__":
    run_pytest(__file__)
