"""The megatron tests' torchrun helpers (common/tests/torchrun.py); megatron-core's own warnings
are silenced in the workers."""

from __future__ import annotations

from critic_adapters.common.tests import torchrun


def worker_env() -> dict:
    return torchrun.worker_env(PYTHONWARNINGS="ignore")


def run_torchrun(nproc: int, module: str, *args: str, timeout: int = 600):
    return torchrun.run_torchrun(nproc, module, *args, env=worker_env(), timeout=timeout)
