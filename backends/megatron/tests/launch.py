"""Run a test worker module under torchrun (CPU, gloo) with this interpreter's import path."""

from __future__ import annotations

import os
import subprocess
import sys


def worker_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore", TRL_EXPERIMENTAL_SILENCE="1")


def run_torchrun(nproc: int, module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", module, *args]
    result = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"torchrun {module} {args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result
