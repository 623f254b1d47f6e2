"""The engine thread: every request that reaches the critic goes through one queue, in arrival order.

  values requests that wait next to each other are packed into one engine call, up to a token budget,
  waiting at most max_wait_s after the first of them for more to arrive; their rows are right-padded
  to one length and every caller gets its own rows back (at its own length), with the version that
  computed them.
  an update, a save, a load, offload / onload run alone, in their place in the queue: a values call
  never straddles an update, so the version it names is the one that computed it.

The queue is bounded (QueueFull: the server answers 429). A caller that went away still has its work
done (an update is applied and recorded, so that its retry gets the answer) and its answer dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import torch

from ..common.engine import RolloutBatch
from ..common.storage import checkpoints
from .ledger import Journal, Ledger
from .schema import UpdateRequest, ValuesRequest, finite_or_none

LEDGER_KEY = "serve_ledger"
"""The checkpoint's extra_state key under which the ledger is saved."""


class QueueFull(Exception):
    pass


class Stopped(Exception):
    """The server is shutting down."""


@dataclasses.dataclass(slots=True)
class _Work:
    kind: str
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
    def __init__(self, critic, config: BatchingConfig, *, ledger: Ledger, journal: Journal, checkpoint_root: str,
                 save_every: int, keep_last: int, metrics, say=print):
        self.critic, self.config, self.ledger, self.journal = critic, config, ledger, journal
        self.checkpoint_root, self.save_every, self.keep_last = checkpoint_root, save_every, keep_last
        self.metrics, self.say = metrics, say
        self._queue: collections.deque[_Work] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._arriving = 0  # values requests the server has accepted and is still reading or checking
        self._thread = threading.Thread(target=self._loop, name="critic-engine", daemon=True)
        self.version = critic.version
        self.position: dict = {}
        """The extra state of the checkpoint loaded (a training run's data position), kept in the saves."""
        self.metrics.set(version=self.version)

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

    def submit(self, kind: str, payload, resolve, *, arrived: bool = False) -> None:
        """Queue work; QueueFull when max_queue requests wait, Stopped once the server is stopping.
        arrived: a values request counted by arriving(+1), no longer on its way (whether queued or refused)."""
        with self._cond:
            self._arriving -= int(arrived)
            if self._stopping:
                raise Stopped("the server is shutting down")
            if len(self._queue) >= self.config.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (the server's --max-queue)")
            self._queue.append(_Work(kind, payload, resolve, time.monotonic()))
            self.metrics.set(queue_depth=len(self._queue))
            self._cond.notify()

    def stop(self) -> None:
        """Finish what is queued, then end the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # -- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                first = self._queue.popleft()
                group = [first]
                if first.kind == "values" and self.config.batching and first.payload.multi_modal_inputs is None:
                    group = self._gather_values(first)
                self.metrics.set(queue_depth=len(self._queue))
            if first.kind == "values":
                self._run_values(group)
            else:
                self._run_one(first)

    def _gather_values(self, first: _Work) -> list[_Work]:
        """(under the lock) `first` and the values requests that follow it, up to the token budget,
        waiting until max_wait_s after `first` arrived for more while others are on their way (a lone
        request does not wait)."""
        group, tokens = [first], first.payload.tokens
        deadline = first.arrived + self.config.max_wait_s
        while tokens < self.config.token_budget:
            if self._queue:
                head = self._queue[0]
                if head.kind != "values" or head.payload.multi_modal_inputs is not None \
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

    def _run_values(self, group: list[_Work]) -> None:
        requests: list[ValuesRequest] = [work.payload for work in group]
        width = max(r.input_ids.shape[1] for r in requests)
        input_ids = torch.cat([_right_pad(r.input_ids, width) for r in requests])
        attention_mask = torch.cat([_right_pad(r.attention_mask, width) for r in requests])
        images = requests[0].multi_modal_inputs if len(requests) == 1 else None
        try:
            values, version = self.critic.compute_values(input_ids, attention_mask, images, return_version=True)
        except Exception as err:  # noqa: BLE001 - every caller of the call gets it
            for work in group:
                work.resolve(None, err)
            return
        self.metrics.engine_call(rows=input_ids.shape[0], tokens=int(attention_mask.sum()), requests=len(group))
        start = 0
        for work, request in zip(group, requests):
            rows, own = request.input_ids.shape
            work.resolve((values[start:start + rows, :own], version), None)
            start += rows

    def _run_one(self, work: _Work) -> None:
        try:
            result = getattr(self, f"_{work.kind}")(work.payload)
        except Exception as err:  # noqa: BLE001 - answered to the caller
            work.resolve(None, err)
            return
        work.resolve(result, None)

    def _update(self, request: UpdateRequest) -> tuple[dict, bool]:
        """(the answer, whether it is the first answer of an update applied before)."""
        seen = self.ledger.answer(request.request_id, request.digest)
        if seen is not None:
            self.metrics.set(replayed_updates=self.metrics.replayed_updates + 1)
            return seen, True
        answer = self.apply(request)
        self.journal.append(request.to_json(), request.digest, answer)
        if self.save_every and self.version % self.save_every == 0:
            self._save(None)
        return answer, False

    def apply(self, request: UpdateRequest) -> dict:
        """Apply an update (no ledger check) and record its answer in the ledger."""
        batch = RolloutBatch(request.input_ids, request.attention_mask, request.response_mask, request.old_values,
                             request.returns, request.value_mask, request.multi_modal_inputs)
        metrics = self.critic.update(batch)
        self.version = self.critic.version
        self.metrics.set(version=self.version)
        answer = {"request_id": request.request_id, "version": self.version,
                  "metrics": {name: finite_or_none(float(value)) for name, value in metrics.items()}}
        self.ledger.record(request.request_id, request.digest, answer)
        return answer

    def _save(self, path: str | None) -> dict:
        """A checkpoint with the ledger: under checkpoint_root as step_<version> (marked latest, older ones
        pruned, the journal emptied), or at `path`."""
        directory = path or checkpoints.step_dir(self.checkpoint_root, self.version)
        extra_state = {**self.position, "global_step": self.version, LEDGER_KEY: self.ledger.entries()}
        self.critic.save_checkpoint(directory, extra_state)
        if path is None:
            checkpoints.mark_latest(self.checkpoint_root, directory)
            checkpoints.prune(self.checkpoint_root, keep_last=self.keep_last)
            self.journal.clear()
        self.say(f"checkpoint saved: {directory} (version {self.version})")
        return {"path": directory, "version": self.version}

    def save(self, path: str | None) -> dict:
        return self._save(path)

    def restore(self, path: str) -> None:
        """The weights, version and ledger of a checkpoint (a training run's: its data position kept)."""
        state = dict(self.critic.load_checkpoint(path))
        self.ledger = Ledger(state.pop(LEDGER_KEY, None))
        state.pop("extra_tensors", None)
        self.position = state
        self.version = self.critic.version
        self.metrics.set(version=self.version)

    def _load(self, path: str) -> dict:
        self.restore(path)
        # The journal's updates were applied to the state just replaced: a restart must start from this
        # one, so it becomes the latest checkpoint; the run's checkpoints at or past its version belong to
        # the line of updates it replaced, so they move aside (kept) rather than outrank it.
        self._supersede_from(self.version)
        self._save(None)
        return {"path": path, "version": self.version}

    def _supersede_from(self, version: int) -> None:
        import os
        import re
        import shutil
        import time

        later = [path for path in checkpoints.complete_checkpoints(self.checkpoint_root)
                 if int(re.search(r"(\d+)$", os.path.basename(path)).group(1)) >= version]
        if not later:
            return
        aside = os.path.join(self.checkpoint_root, time.strftime("superseded-%Y%m%dT%H%M%S"))
        os.makedirs(aside, exist_ok=True)
        for path in later:
            shutil.move(path, os.path.join(aside, os.path.basename(path)))
        self.say(f"{len(later)} checkpoint(s) past the loaded version {version} moved to {aside}")

    def _offload(self, _) -> dict:
        self.critic.offload()
        return {"offloaded": True}

    def _onload(self, _) -> dict:
        self.critic.onload()
        return {"offloaded": False}


def _right_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))
