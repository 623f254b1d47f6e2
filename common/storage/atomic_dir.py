"""Write a directory atomically: build it under a temporary name beside the target, then rename.

An interrupted write never leaves a half-written target, and never destroys the previous one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def is_nonempty_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


@contextlib.contextmanager
def atomic_directory(target: str, *, overwrite: bool = False, flag: str = "overwrite=True"):
    """Yield a fresh temporary directory that becomes `target` when the block succeeds.

    An existing non-empty `target` is an error unless `overwrite`; then it is replaced only after
    the new directory is complete. `flag` names the option that allows overwriting, for the error.
    """
    target = os.path.abspath(target)
    if os.path.exists(target) and not os.path.isdir(target):
        raise FileExistsError(f"{target} exists and is not a directory")
    if is_nonempty_dir(target) and not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; choose a new directory or pass {flag}")
    staging = make_staging_dir(target)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    commit_staging_dir(staging, target)


def make_staging_dir(target: str) -> str:
    """A new empty directory beside `target` (`.<name>.tmp-*`), to become `target` when complete."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    # mkdtemp makes it 0700 whatever the umask; the finished directory gets what os.makedirs would
    # give (on a shared cluster, a group-readable umask must give a group-readable export).
    os.chmod(staging, 0o777 & ~current_umask())
    return staging


def current_umask() -> int:
    """The process's umask: from /proc on Linux (read-only); elsewhere reading it means setting it,
    so it is set straight back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def commit_staging_dir(staging: str, target: str) -> None:
    """Put a complete staging directory in place of `target`; an old `target` is removed only after."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    if os.path.exists(target):
        retired = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=parent)
        os.rename(target, os.path.join(retired, "dir"))
        os.rename(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, target)


def unwritable_reason(path: str) -> str | None:
    """Why files cannot be created at `path` (a directory, made if missing), or None if they can.

    Tries a real (unnamed, immediately removed) temporary file in `path`, or in its nearest existing
    parent when `path` does not exist yet: permission bits do not tell the truth for root or on a
    read-only mount. Nothing is left behind.
    """
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot create files in {existing} ({err.strerror})"
    return None
