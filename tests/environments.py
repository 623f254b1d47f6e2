"""The Python environments a cross-environment test runs its workers in: the venv (tools/setup.sh's
pinned one) and the verl overlay over it (.overlays/verl-0.9.1: verl 0.9.1 with transformers 5.10.4, the
transformers verl pins, older than the venv's). A worker gets the environment as its process
environment (PYTHONPATH first)."""

from __future__ import annotations

import os

from critic_adapters.common.tests.torchrun import worker_env

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
VERL_OVERLAY = os.environ.get("CRITIC_VERL_OVERLAY", os.path.join(REPO, ".overlays", "verl-0.9.1"))


def verl_overlay_env(**extra: str) -> dict:
    """worker_env with the verl overlay first on PYTHONPATH; CRITIC_VERL_OVERLAY=none: this environment
    has verl installed itself (tools/env-matrix's verl environment), worker_env as it is."""
    if VERL_OVERLAY == "none":
        return worker_env(**extra)
    assert os.path.isfile(os.path.join(VERL_OVERLAY, ".complete")), (
        f"missing the verl overlay {VERL_OVERLAY}; tools/setup.sh installs it (or set CRITIC_VERL_OVERLAY)")
    env = worker_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([VERL_OVERLAY, env["PYTHONPATH"]])
    return env


ENVIRONMENTS = {"venv": worker_env, "verl-overlay": verl_overlay_env}
