"""Where a run's checkpoints live: step directories, the `latest` pointer, and retention.

run_dir/checkpoints/step_000012/   a complete checkpoint (written atomically by the engine)
run_dir/checkpoints/latest         the name of the newest complete one (replaced atomically)
Staging directories of an interrupted save (".step_*.tmp-*") are never read and are cleaned up.
"""

from __future__ import annotations

import os
import re
import shutil

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
LATEST = "latest"
# Every engine writes this file into a checkpoint, last: its presence marks a complete checkpoint.
META_FILE = "critic_checkpoint.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def complete_checkpoints(root: str, marker: str = META_FILE) -> list[str]:
    """Step directories that hold `marker` (the engine's last-written file), oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n) and os.path.isfile(os.path.join(root, n, marker)))
    return [os.path.join(root, n) for n in names]


def find_latest(root: str, marker: str = META_FILE) -> str | None:
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            candidate = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(candidate, marker)):
            return candidate
    found = complete_checkpoints(root, marker)
    return found[-1] if found else None


def mark_latest(root: str, directory: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(directory) + "\n")
    os.replace(tmp, os.path.join(root, LATEST))


def prune(root: str, keep_last: int, marker: str = META_FILE) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints, and leftover staging directories."""
    removed = complete_checkpoints(root, marker)[:-keep_last]
    removed += [os.path.join(root, n) for n in os.listdir(root) if n.startswith(".step_") and ".tmp-" in n]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
