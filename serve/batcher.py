"""The engine thread: every request that reaches the critic goes through one queue, in arrival order.

  values requests that wait next to each other are packed into one engine call, up to a token budget,
  waiting at most max_wait_s after the first of them for more to arrive; their rows are right-padded
  to one length and every caller gets its own rows back (at its own length), with the version that
  computed them.
  an update, a save, a load, offload / onload run alone, in their place in the queue: a values call
  never straddles an update, so the version it names is the one that computed it. Updates, saves and
  loads are serve/updates.py's (exactly once); values and updates that meet an offloaded critic are
  answered Offloaded (503), whenever they were queued.

The queue is bounded (QueueFull: the server answers 429). A caller that went away still has its work
done (an update is applied and recorded, so that its retry gets the answer) and its answer dropped.
When the service cannot go on (a rank gone, the engine thread dead, an update that could not be
recorded) it fails: the work in hand and queued is answered ServiceBroken (503) with the reason, new
work is refused alike, health says so, and on_fatal stops the server.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time

import torch

from .updates import ServiceBroken, Updates


class Kind(enum.Enum):
    """The work the engine thread does: the closed set every route maps to."""

    VALUES = "values"
    UPDATE = "update"
    SAVE = "save"
    LOAD = "load"
    OFFLOAD = "offload"
    ONLOAD = "onload"
    SET_VERSION = "set_version"
    # Bodies of AReaL's routes (serve/areal.py), read into VALUES and UPDATE work.
    AREAL_VALUES = "areal_values"
    AREAL_UPDATE = "areal_update"


NEEDS_THE_CRITIC_ON = frozenset({Kind.VALUES, Kind.UPDATE})


class QueueFull(Exception):
    pass


class Stopped(Exception):
    """The server is shutting down."""


class Offloaded(Exception):
    """The critic is offloaded (an admin POST /v1/onload brings it back)."""


@dataclasses.dataclass(slots=True)
class _Work:
    kind: Kind
    payload: object
    resolve: object
    """resolve(result, error): called on the engine thread with exactly one of them."""
    arrived: float


@dataclasses.dataclass(frozen=True, slots=True)
class BatchingConfig:
    token_budget: int = 16384
    """Tokens (attention_mask ones) in one engine values call."""
    max_wait_s: float = 0.005
    """How long the first values request of a call waits for others to join it (0: never waits)."""
    max_queue: int = 1024
    """Requests waiting at once; more are answered 429."""
    batching: bool = True
    """False: one engine call per request (the benchmark's baseline)."""


class Batcher:
    def __init__(self, critic, config: BatchingConfig, *, updates: Updates, metrics, on_fatal=None, say=print):
        self.critic, self.config, self.updates = critic, config, updates
        self.metrics, self.on_fatal, self.say = metrics, on_fatal, say
        self._queue: collections.deque[_Work] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._arriving = 0  # values requests the server has accepted and is still reading or checking
        self._thread = threading.Thread(target=self._loop, name="critic-engine", daemon=True)
        self.offloaded = False
        self.failure: str | None = None
        """Why the service cannot go on (None while it can)."""
        self._handlers = {Kind.UPDATE: updates.update, Kind.SAVE: updates.save, Kind.LOAD: updates.load,
                          Kind.OFFLOAD: self._offload, Kind.ONLOAD: self._onload, Kind.SET_VERSION: updates.set_version}

    @property
    def version(self) -> int:
        return self.updates.version

    # -- the server's side ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def arriving(self, delta: int) -> None:
        """A values request has arrived at the door (+1) or left it for the queue or with an error (-1):
        a values call waits for others to join it only while some are on their way."""
        with self._cond:
            self._arriving += delta
            if delta < 0:
                self._cond.notify()

    def submit(self, kind: Kind, payload, resolve, *, arrived: bool = False) -> None:
        """Queue work; QueueFull when max_queue requests wait, Stopped once the server is stopping,
        ServiceBroken once it failed. arrived: a values request counted by arriving(+1), no longer on
        its way (whether queued or refused)."""
        with self._cond:
            self._arriving -= int(arrived)
            if self.failure is not None:
                raise ServiceBroken(self.failure)
            if self._stopping:
                raise Stopped("the server is shutting down")
            if len(self._queue) >= self.config.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (the server's --max-queue)")
            self._queue.append(_Work(kind, payload, resolve, time.monotonic()))
            self.metrics.set(queue_depth=len(self._queue))
            self._cond.notify()

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /v1/health: 200 while values can be answered."""
        if self.failure is None:
            lost = self.critic.lost()
            if lost is not None:
                self.fail(lost)
        if self.failure is not None:
            return 503, {"status": "failed", "reason": self.failure, "version": self.version}
        if self.offloaded:
            return 503, {"status": "offloaded", "version": self.version}
        return 200, {"status": "ok", "version": self.version}

    def stop(self) -> None:
        """Finish what is queued, then end the engine thread (a failed one is not waited for long: it
        may be stuck in a collective with a rank that is gone)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(None if self.failure is None else 10)

    def fail(self, reason: str) -> None:
        """The service cannot go on: answer the queued work ServiceBroken, refuse new work, stop the server."""
        with self._cond:
            if self.failure is not None:
                return
            self.failure = f"{reason}; the service stops (restart it with --resume)"
            queued = list(self._queue)
            self._queue.clear()
            self.metrics.set(queue_depth=0)
        for work in queued:
            work.resolve(None, ServiceBroken(self.failure))
        self.say(f"error: {self.failure}")
        if self.on_fatal is not None:
            self.on_fatal(self.failure)

    # -- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        group: list[_Work] = []
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if not self._queue:
                        return
                    first = self._queue.popleft()
                    group = [first]
                    if first.kind is Kind.VALUES and self.config.batching and first.payload.multi_modal_inputs is None:
                        group = self._gather_values(first)
                    self.metrics.set(queue_depth=len(self._queue))
                self._run(group)
        except BaseException as err:  # noqa: BLE001 - a dead engine thread must not leave callers waiting
            self.fail(f"the engine thread died: {type(err).__name__}: {err}")
            for work in group:  # the work in hand (a caller answered already ignores a second outcome)
                work.resolve(None, ServiceBroken(self.failure))

    def _gather_values(self, first: _Work) -> list[_Work]:
        """(under the lock) `first` and the values requests that follow it, up to the token budget,
        waiting until max_wait_s after `first` arrived for more while others are on their way (a lone
        request does not wait)."""
        group, tokens = [first], first.payload.tokens
        deadline = first.arrived + self.config.max_wait_s
        while tokens < self.config.token_budget:
            if self._queue:
                head = self._queue[0]
                if head.kind is not Kind.VALUES or head.payload.multi_modal_inputs is not None \
                        or tokens + head.payload.tokens > self.config.token_budget:
                    break
                group.append(self._queue.popleft())
                tokens += head.payload.tokens
                continue
            left = deadline - time.monotonic()
            if left <= 0 or self._stopping or self._arriving <= 0:
                break
            self._cond.wait(left)
        return group

    def _run(self, group: list[_Work]) -> None:
        """Run a piece of work and resolve its callers with its outcome (exactly one each)."""
        kind = group[0].kind
        try:
            if self.failure is not None:
                raise ServiceBroken(self.failure)
            if kind in NEEDS_THE_CRITIC_ON and self.offloaded:
                raise Offloaded("the critic is offloaded; an admin POST /v1/onload brings it back")
            results = self._values(group) if kind is Kind.VALUES else [self._handlers[kind](group[0].payload)]
        except Exception as err:  # noqa: BLE001 - answered to every caller of the call
            reason = str(err) if isinstance(err, ServiceBroken) else self.critic.lost()
            if reason is not None:
                self.fail(reason)
                err = ServiceBroken(self.failure)
            for work in group:
                work.resolve(None, err)
            return
        for work, result in zip(group, results):
            work.resolve(result, None)

    def _values(self, group: list[_Work]) -> list:
        requests = [work.payload for work in group]
        width = max(r.input_ids.shape[1] for r in requests)
        input_ids = torch.cat([_right_pad(r.input_ids, width) for r in requests])
        attention_mask = torch.cat([_right_pad(r.attention_mask, width) for r in requests])
        images = requests[0].multi_modal_inputs if len(requests) == 1 else None
        values = self.critic.compute_values(input_ids, attention_mask, images)
        version = self.updates.version  # the service's: an update of several steps is one version
        self.metrics.engine_call(rows=input_ids.shape[0], tokens=int(attention_mask.sum()), requests=len(group))
        out, start = [], 0
        for request in requests:
            rows, own = request.input_ids.shape
            out.append((values[start:start + rows, :own], version))
            start += rows
        return out

    def _offload(self, _) -> dict:
        self.critic.offload()
        self.offloaded = True
        return {"offloaded": True}

    def _onload(self, _) -> dict:
        self.critic.onload()
        self.offloaded = False
        return {"offloaded": False}


def _right_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))
