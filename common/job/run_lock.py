"""One run per run_dir: an exclusive lock held for the run's lifetime, naming its holder.

run_dir/run.lock is locked with flock and holds the holder's pid. The kernel drops the lock when
the holder exits however it exits (even SIGKILL), so a stale file never blocks a new run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

LOCK_FILE = "run.lock"


def _in_use(run_dir: str, path: str, holder: str) -> ValueError:
    return ValueError(f"{run_dir} is in use by another run (pid {holder or 'unknown'}, lock {path}); wait for it to "
                      f"finish or stop it, or choose another trainer.run_dir")


def check_not_in_use(run_dir: str, *, wait_s: float = 0.0) -> None:
    """The ValueError run_dir_lock would raise, without taking the lock or writing anything: a run
    in progress is reported as such before any other check reads what it has written so far.
    wait_s: how long a held lock may take to be released first (the workers of a run whose launcher was
    just killed leave within a second: common.job.lifeline)."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _in_use(run_dir, path, os.pread(fd, 64, 0).decode(errors="replace").strip()) from None
                time.sleep(0.1)
    finally:
        os.close(fd)  # releases the probe's shared lock


@contextlib.contextmanager
def run_dir_lock(run_dir: str):
    """Hold the run_dir's lock inside the block; a ValueError naming the holder if another run has it."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(run_dir, path, os.pread(fd, 64, 0).decode(errors="replace").strip()) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
