"""The test suite's launch accounting: which processes a test started, of what kind, and how long each
took to become ready (tools/test_times.py reads it into docs/TESTS.md).

Off unless CRITIC_ADAPTERS_LAUNCH_LOG names a file (common.tests.helpers.run_pytest sets it in
each test process; every process it starts inherits it): then the package's import appends one
line per process, and `ready(...)` one more when the process has joined its world or started
serving. Standard library only, and nothing happens when the variable is unset: this runs on every
import of the package.
"""

from __future__ import annotations

import json
import os
import sys
import time

VARIABLE = "CRITIC_ADAPTERS_LAUNCH_LOG"


def _process_start_epoch() -> float | None:
    """When this process started (Linux: /proc), so start-up counts the interpreter's own start."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        return time.time() - up + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _command_line() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            return [part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part]
    except OSError:
        return list(sys.argv)


def _kind(command: list[str]) -> str:
    """torchrun (a rank of a torchrun world), ray (a Ray worker), server (the critic service) or
    python (any other interpreter a test started: a launcher, a one-rank worker, a helper)."""
    text = " ".join(command)
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        return "torchrun"
    if text.startswith("ray::") or ("ray" in text and "default_worker" in text):  # Ray sets its workers' titles
        return "ray"
    if "critic_adapters.serve" in text:
        return "server"
    return "python"


def _append(record: dict) -> None:
    path = os.environ.get(VARIABLE)
    if not path:
        return
    try:  # one short line per write: appends from concurrent processes do not interleave
        with open(path, "a") as log:
            log.write(json.dumps(record) + "\n")
    except OSError:
        pass


def record_start() -> None:
    """This process imported the package: one line (its kind, parent, start time, torchrun run id)."""
    if os.getpid() == _int(os.environ.get(VARIABLE + "_OWNER")):
        return  # the test process itself
    command = _command_line()
    _append({"event": "start", "pid": os.getpid(), "ppid": os.getppid(), "kind": _kind(command),
             "started": _process_start_epoch(), "imported": time.time(),
             "run": os.environ.get("TORCHELASTIC_RUN_ID"), "command": " ".join(command)[:300]})


def ready(what: str) -> None:
    """This process is ready for its work (joined its world, started serving): its start-up is over."""
    if not os.environ.get(VARIABLE) or os.getpid() == _int(os.environ.get(VARIABLE + "_OWNER")):
        return
    _append({"event": "ready", "pid": os.getpid(), "what": what, "at": time.time()})


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None
