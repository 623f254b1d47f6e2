"""Exactly-once updates: the answers of the updates applied, by request_id, and a journal that makes
them survive a restart.

  an update arrives -> its request_id is in the ledger: the first answer again (a different update
  under the same id: refused, 409) -> else it is applied, then written to the journal (fsync'd)
  before its answer leaves.
  a checkpoint holds the ledger as of its version; the journal is then emptied.
  --resume: the checkpoint's weights and ledger, then the journal's updates past its version applied
  again in order (the same updates in the same order from the same state: the same weights), so a
  server killed at any point and restarted holds every answered update exactly once, and a retry of
  one gets its first answer.

An update killed before it reached the journal was never answered: its retry applies it, once.
The ledger keeps the last KEEP answers (a retry older than that would be applied again; retries come
seconds later, not thousands of updates later).
"""

from __future__ import annotations

import collections
import json
import os

KEEP = 100_000


class Conflict(Exception):
    """A request_id already used for a different update."""


class Ledger:
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
    """run_dir/serve/journal.jsonl: one line per update answered since the last checkpoint (the body
    and its answer), appended and fsync'd before the answer is sent."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def append(self, body: dict, digest: str, answer: dict) -> None:
        line = json.dumps({"body": body, "digest": digest, "answer": answer}, allow_nan=True) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def entries(self) -> list[dict]:
        """The complete lines (a line cut short by a kill mid-write was never answered: dropped)."""
        try:
            with open(self.path) as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def clear(self) -> None:
        """After a checkpoint: what the journal held is in the checkpoint now."""
        tmp = self.path + ".tmp"
        open(tmp, "w").close()
        os.replace(tmp, self.path)
