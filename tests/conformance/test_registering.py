"""A backend a host registers gets the conformance suite by registering: collected with a plugin
that registers one (host_backend.py), the suite has every test for it too, and Bazel's shards
(backends round-robin) run it whole in one of them."""

import collections
import functools
import os
import subprocess
import sys

from critic_adapters.common.engine.registry import BACKENDS
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.tests.conformance import test_conformance

SUITE = test_conformance.__file__


@functools.cache
def collected(shard: int, shards: int = 3) -> tuple[str, ...]:
    """The suite's test ids in one Bazel shard, as Bazel runs the file (the main script: run_pytest
    and its sharding), listed only, with the host's plugin loaded."""
    env = dict(os.environ, TEST_SHARD_INDEX=str(shard), TEST_TOTAL_SHARDS=str(shards))
    env.pop("CONFORMANCE_BACKEND", None)
    env.pop("TEST_SHARD_STATUS_FILE", None)
    code = f"import runpy; runpy.run_path({SUITE!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code, "--collect-only", "-p",
                           "critic_adapters.tests.conformance.host_backend"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr
    return tuple(line for line in proc.stdout.splitlines() if "::" in line)


def backend_of(test_id: str) -> str:
    params = test_id.split("[", 1)[1].rstrip("]").split("-")
    return next(p for p in params if p in ("fsdp", "host_fsdp", "megatron", "veomni"))


def test_a_registered_backend_gets_every_conformance_test():
    assert "host_fsdp" not in BACKENDS  # only the plugin registers it
    every = [test_id for shard in range(3) for test_id in collected(shard)]
    per_backend = collections.Counter(backend_of(test_id) for test_id in every)
    assert set(per_backend) == {"fsdp", "host_fsdp", "megatron", "veomni"}, per_backend
    assert per_backend["host_fsdp"] == per_backend["fsdp"] == per_backend["veomni"] > 5, per_backend


def test_bazel_shards_run_whole_backends():
    owners = [{backend_of(test_id) for test_id in collected(shard)} for shard in range(3)]
    assert all(owners), owners  # every shard has work
    assert sorted(name for names in owners for name in names) == ["fsdp", "host_fsdp", "megatron", "veomni"], owners


if __name__ == "__main__":
    run_pytest(__file__)
