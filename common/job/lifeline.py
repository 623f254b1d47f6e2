"""Workers die with the launcher that started them.

torchrun starts each worker in a session of its own, so a launcher killed with SIGKILL (or a
crashed terminal) would leave the workers training and writing to the run_dir; torchrun's agent
runs in the launcher's process and dies with it. So each worker watches the launcher's pid (from
LAUNCHER_PID_ENV) and exits when it is gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time

LAUNCHER_PID_ENV = "CRITIC_LAUNCHER_PID"


def _process_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time) of `pid` from /proc, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def process_identity(pid: int) -> str | None:
    """What tells `pid` apart from a later process that reuses the number (its start time), or None
    when there is no such process or no /proc to ask."""
    state = _process_state(pid)
    return None if state is None else state[1]


def is_gone(pid: int, identity: str | None) -> bool:
    """Whether the process process_identity() described has exited: no such process, a zombie (exited,
    not yet reaped by its parent), or its number reused. False where /proc cannot tell (identity None)."""
    if identity is None:
        return False
    state = _process_state(pid)
    return state is None or state[0] in "ZX" or state[1] != identity


def exit_when_gone(pid: int, poll_s: float = 0.5) -> bool:
    """Start a daemon thread that ends this process once `pid` has exited; False when it cannot watch
    (no /proc). A zombie counts as gone, and a recycled pid is told apart by its start time."""
    first = _process_state(pid)
    if first is None:
        if os.path.isdir("/proc"):
            _leave(pid)
        return False
    started = first[1]

    def watch() -> None:
        while True:
            if is_gone(pid, started):
                _leave(pid)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()
    return True


def _leave(pid: int) -> None:
    print(f"error: the launcher (pid {pid}) has exited; stopping this worker", file=sys.stderr, flush=True)
    os._exit(1)
