"""Run a module under torchrun from a test (CPU, gloo), with this interpreter's import path."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_command(nproc: int, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", module, *args]


def launcher_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
                TRL_EXPERIMENTAL_SILENCE="1")


def run_torchrun(nproc: int, module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(torchrun_command(nproc, module, *args), env=launcher_env(), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"torchrun {module} {args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def run_launcher(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """python -m critic_adapters.backends.fsdp.train ARGS (it relaunches itself under torchrun for --nproc > 1)."""
    return subprocess.run([sys.executable, "-m", "critic_adapters.backends.fsdp.train", *args], env=launcher_env(),
                          capture_output=True, text=True, timeout=timeout)
