"""The FSDP tests' torchrun and launcher helpers (common/tests/torchrun.py)."""

from __future__ import annotations

import functools

from critic_adapters.common.tests.torchrun import run_torchrun, torchrun_command, worker_env  # noqa: F401
from critic_adapters.common.tests.torchrun import run_launcher as _run_launcher
from critic_adapters.common.tests.torchrun import run_launcher_in_process

launcher_env = worker_env
LAUNCHER = "critic_adapters.backends.fsdp.train"
run_launcher = functools.partial(_run_launcher, LAUNCHER)
# For launches that end before training (refusals, dry runs): no new interpreter.
launch_in_process = functools.partial(run_launcher_in_process, LAUNCHER)
