"""critic-adapters: one PPO critic (value model) for RL-for-LLM stacks, on several training backends.

This directory is the package `critic_adapters` (pip install -e . here, or a Bazel workspace of the
same name); inside it every import is relative, so a copy under any package path works unchanged.
"""

import os as _os

if _os.environ.get("CRITIC_ADAPTERS_LAUNCH_LOG"):  # the test suite's launch accounting (tools/test_times.py)
    from .common.parallel import launch_log as _launch_log

    _launch_log.record_start()
