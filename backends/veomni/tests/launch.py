"""The VeOmni tests' torchrun and launcher helpers (common/tests/torchrun.py)."""

from __future__ import annotations

import functools

from critic_adapters.common.tests.torchrun import run_torchrun, worker_env  # noqa: F401
from critic_adapters.common.tests.torchrun import run_launcher as _run_launcher

LAUNCHER = "critic_adapters.backends.veomni.train"
run_launcher = functools.partial(_run_launcher, LAUNCHER)
