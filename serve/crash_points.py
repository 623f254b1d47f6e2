"""Crash points for the service's fault tests: with CRITIC_SERVE_CRASH=<point>:<n> in its environment, a
process of the service ends itself with SIGKILL the n-th time it reaches <point>. A kill between two steps
of the exactly-once sequence cannot be timed from outside; this puts it exactly there (serve/tests/
test_faults.py). Unset, as it always is outside those tests, nothing happens.

  after-apply       rank 0: an update applied by the engine, not yet in the journal
  mid-journal       rank 0: half of an update's journal line written and fsync'd (a torn line)
  after-journal     rank 0: an update in the journal, its answer not yet sent
  follower-command  a follower rank: a command received from rank 0, before it runs (a rank that dies
                    in the middle of a request)
"""

from __future__ import annotations

import os
import signal

ENV = "CRITIC_SERVE_CRASH"
POINTS = ("after-apply", "mid-journal", "after-journal", "follower-command")


class CrashPoints:
    def __init__(self, spec: str | None = None):
        spec = os.environ.get(ENV) if spec is None else spec
        self.point, self.at, self.reached = None, 0, 0
        if spec:
            point, _, count = spec.partition(":")
            if point not in POINTS or not count.isdigit() or int(count) < 1:
                raise ValueError(f"{ENV}={spec!r}: expected <point>:<n> with a point of {', '.join(POINTS)} and n >= 1")
            self.point, self.at = point, int(count)

    def _due(self, point: str) -> bool:
        if point != self.point:
            return False
        self.reached += 1
        return self.reached == self.at

    def reach(self, point: str) -> None:
        assert point in POINTS, point
        if self._due(point):
            _die()

    def mid_line(self, f, line: bytes) -> None:
        """Journal.append's hook: at the chosen line, half of it reaches the disk, then the process dies."""
        if self._due("mid-journal"):
            f.write(line[: len(line) // 2])
            f.flush()
            os.fsync(f.fileno())
            _die()

    @property
    def armed(self) -> bool:
        return self.point is not None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
