"""Run a module under torchrun, or the VeOmni launcher, from a test (CPU, gloo), with this
interpreter's import path."""

from __future__ import annotations

import os
import subprocess
import sys

LAUNCHER = "critic_adapters.backends.veomni.train"


def worker_env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
                TRL_EXPERIMENTAL_SILENCE="1", **extra)


def run_torchrun(nproc: int, module: str, *args: str, env: dict | None = None,
                 timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", module, *args]
    result = subprocess.run(command, env=env or worker_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"torchrun {module} {args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def run_launcher(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """python -m critic_adapters.backends.veomni.train ARGS (it relaunches itself under torchrun for --nproc > 1)."""
    return subprocess.run([sys.executable, "-m", LAUNCHER, *args], env=worker_env(), capture_output=True, text=True,
                          timeout=timeout)
