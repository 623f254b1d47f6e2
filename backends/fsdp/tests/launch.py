"""The FSDP tests' torchrun and launcher helpers (common/tests/torchrun.py)."""

from __future__ import annotations

import functools

from critic_adapters.common.tests.torchrun import run_torchrun, torchrun_command, worker_env  # noqa: F401
from critic_adapters.common.tests.torchrun import run_launcher as _run_launcher

launcher_env = worker_env
run_launcher = functools.partial(_run_launcher, "critic_adapters.backends.fsdp.train")
