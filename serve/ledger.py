"""The records that make updates exactly once: the answers given, by request_id (Ledger), and the
journal of the updates answered since the last checkpoint (Journal). serve/updates.py owns the order
in which they are written.

The journal is one JSON line per answered update (the canonical body, its digest, its answer),
fsync'd before the answer leaves. A line is only ever written at the end of the last complete line:
an append that fails is cut back off (a write that ran out of space leaves nothing), and a line torn
by a kill mid-write (never answered) is cut off when the journal is next opened, so the next answered
update never lands on a torn line. It is read one line at a time.
"""

from __future__ import annotations

import collections
import json
import os

KEEP = 100_000
ENTRY_START = b'{"body": '
"""How every journal line starts (json.dumps of the entry, "body" first). Inside a line it cannot occur
but at a line's start (a string holding it is written with escaped quotes), so a line that a writer
before the cut-back appended onto a torn one is found again from it."""


class Conflict(Exception):
    """A request_id already used for a different update."""


class JournalCorrupt(ValueError):
    """A journal line that is neither complete nor the torn last line of a kill mid-write."""


class Ledger:
    """The last KEEP answers by request_id (a retry older than that would be applied again; retries come
    seconds later, not thousands of updates later)."""

    def __init__(self, entries: list | None = None, keep: int = KEEP):
        self.keep = keep
        self._answers: collections.OrderedDict[str, tuple[str, dict]] = collections.OrderedDict()
        for request_id, digest, answer in entries or ():
            self.record(request_id, digest, answer)

    def answer(self, request_id: str, digest: str) -> dict | None:
        """The first answer to this update, or None when it was never applied; Conflict when the id
        named a different update."""
        seen = self._answers.get(request_id)
        if seen is None:
            return None
        if seen[0] != digest:
            raise Conflict(f"request_id {request_id!r} was already used for a different update (applied at "
                           f"version {seen[1].get('version')}); give every update its own id")
        return seen[1]

    def record(self, request_id: str, digest: str, answer: dict) -> None:
        self._answers[request_id] = (digest, answer)
        while len(self._answers) > self.keep:
            self._answers.popitem(last=False)

    def entries(self) -> list:
        return [[request_id, digest, answer] for request_id, (digest, answer) in self._answers.items()]

    def __len__(self) -> int:
        return len(self._answers)


class Journal:
    """run_dir/serve/journal.jsonl: one line per update answered since the last checkpoint."""

    def __init__(self, path: str, *, crash_mid_line=None):
        self.path = path
        self._crash_mid_line = crash_mid_line  # serve/crash_points.py: a kill half-way through a line
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._file = None
        self._end = 0  # the end of the last complete line: where the next line goes

    # -- writing ----------------------------------------------------------------------------------
    def _open(self):
        if self._file is None:
            created = not os.path.exists(self.path)
            self._file = open(self.path, "ab+")
            if created:
                _fsync_directory(os.path.dirname(self.path))  # the file's name survives a crash too
            self._end = self._file.seek(0, os.SEEK_END)  # recover() has cut a torn tail before
        return self._file

    def append(self, body: dict, digest: str, answer: dict) -> None:
        """The line, on disk (fsync'd) when this returns; an OSError leaves the journal as it was."""
        line = json.dumps({"body": body, "digest": digest, "answer": answer}, allow_nan=True).encode() + b"\n"
        assert line.startswith(ENTRY_START)
        f = self._open()
        try:
            f.truncate(self._end)  # "ab+" writes at the end: the end is the last complete line's
            if self._crash_mid_line is not None:
                self._crash_mid_line(f, line)
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            try:  # a full disk: what was written of the line goes (truncating frees space, it needs none)
                f.truncate(self._end)
                os.fsync(f.fileno())
            except OSError:
                pass  # the next append cuts it first, and so does recover()
            raise
        self._end += len(line)

    def size(self) -> int:
        return self._end if self._file is not None else _size(self.path)

    def clear(self) -> None:
        """After a checkpoint: what the journal held is in the checkpoint now."""
        self.close()
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_directory(os.path.dirname(self.path))
        self._end = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- reading (at resume) ----------------------------------------------------------------------
    def recover(self, say=print):
        """Yield the journal's entries in order, one line at a time. A torn last line (a kill mid-write:
        never answered) is cut off the file, and said; a line appended onto a torn one (by a writer that
        did not cut it) is read from where it starts; any other unreadable line is JournalCorrupt."""
        if not os.path.isfile(self.path):
            return
        offset = 0
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, 1):
                complete = line.endswith(b"\n")
                entry = _entry(line) if complete else None
                if entry is None:
                    if not complete or not f.peek(1):  # the last line: torn by a kill mid-write
                        self._cut(offset, len(line), say)
                        return
                    start = line.find(ENTRY_START, 1)
                    entry = _entry(line[start:]) if start > 0 else None
                    if entry is None:
                        raise JournalCorrupt(
                            f"{self.path}: line {number} is not a journal entry and is not the last line (the "
                            f"file was changed by hand, or the disk lost data); the updates after it cannot be "
                            f"trusted: move the journal away to serve the last checkpoint alone")
                    say(f"journal: line {number} held {start} bytes of a torn line before an answered update; "
                        f"the update is kept")
                offset += len(line)
                yield entry

    def _cut(self, offset: int, length: int, say) -> None:
        with open(self.path, "rb+") as f:
            f.truncate(offset)
            os.fsync(f.fileno())
        say(f"journal: cut a torn last line ({length} bytes at offset {offset}: an update killed while it was "
            f"written, never answered; its retry applies it)")


def _entry(line: bytes) -> dict | None:
    try:
        entry = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return entry if isinstance(entry, dict) and {"body", "digest", "answer"} <= set(entry) else None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
