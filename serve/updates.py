"""Updates exactly once, and the checkpoints that hold them: the one owner of the order in which an
update becomes durable (the engine thread calls it; serve/batcher.py).

  an update whose request_id was answered before: that answer again (another update under the id: 409)
  else: apply (the engine's step) -> journal (one line, fsync) -> ledger -> answer
    the step fails: nothing is recorded; the engines check their input before touching the weights
    the journal cannot be written (a full disk): a checkpoint takes the update instead (it holds the
      ledger, so the answer and the disk agree); if that fails as well the service stops (ServiceBroken):
      the update was not answered and the disk does not hold it, so its retry after --resume applies it once
    a checkpoint after it (--save-every, --journal-limit-mb) fails: the update is answered all the same
      (the journal holds it), the failure is said, and the next update tries again
  a kill at any step: --resume (resume()) loads the last checkpoint (weights, optimizer, ledger) and applies
    the journal's updates past it again, in order, from the same state: the same weights. A line torn by
    the kill was never answered: it is cut off, and its retry applies it once.

The run's checkpoints are run_dir/checkpoints/step_<version>; an admin save to another path writes only a
new directory or over a critic checkpoint (critic_checkpoint.json), never over anything else.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy

from ..common.engine import RolloutBatch
from ..common.storage import checkpoints
from ..common.storage.atomic_dir import unwritable_reason
from .ledger import Journal, Ledger
from .schema import RequestError, UpdateRequest, finite_or_none

LEDGER_KEY = "serve_ledger"
"""The checkpoint's extra_state key under which the ledger is saved."""
SUPERSEDED = "superseded-"


class ServiceBroken(Exception):
    """The service cannot go on (the reason): every request is answered 503 with it, and it stops."""


class Updates:
    def __init__(self, critic, *, journal: Journal, checkpoint_root: str, save_every: int, journal_limit_bytes: int,
                 keep_last: int, metrics, crash, say=print):
        self.critic, self.journal, self.checkpoint_root = critic, journal, os.path.abspath(checkpoint_root)
        self.save_every, self.journal_limit_bytes, self.keep_last = save_every, journal_limit_bytes, keep_last
        self.metrics, self.crash, self.say = metrics, crash, say
        self.ledger = Ledger()
        self.version = critic.version
        self.last_metrics: dict = {}
        """The last update's metrics (AReaL's export_stats)."""
        self.position: dict = {}
        """The extra state of the checkpoint loaded (a training run's data position), kept in the saves."""
        self._unsaved = 0  # updates since the last checkpoint of the run
        self.metrics.set(version=self.version)

    # -- an update ------------------------------------------------------------------------------------
    def update(self, request: UpdateRequest) -> tuple[dict, bool]:
        """(the answer, whether it is the first answer of an update applied before)."""
        seen = self.ledger.answer(request.request_id, request.digest)
        if seen is not None:
            self.metrics.set(replayed_updates=self.metrics.replayed_updates + 1)
            return seen, True
        answer = self._apply(request)
        self.crash.reach("after-apply")
        if self._journal(request, answer):
            self.crash.reach("after-journal")
            self._unsaved += 1
        self.ledger.record(request.request_id, request.digest, answer)
        if (self.save_every and self._unsaved >= self.save_every) or self.journal.size() >= self.journal_limit_bytes:
            try:
                self._checkpoint()
            except Exception as err:  # noqa: BLE001 - the journal holds the update: answered all the same
                self.metrics.set(checkpoint_failures=self.metrics.checkpoint_failures + 1)
                self.say(f"warning: the checkpoint after update {request.request_id!r} (version {self.version}) "
                         f"failed: {type(err).__name__}: {err}; the journal holds the {self._unsaved} update(s) since "
                         f"the last one, and the next update tries again")
        return answer, False

    def _apply(self, request: UpdateRequest) -> dict:
        """The update's optimizer steps (one per mini-batch: minibatch_groups), then one version more.
        Its metrics are the steps' means."""
        batch = RolloutBatch(request.input_ids, request.attention_mask, request.response_mask, request.old_values,
                             request.returns, request.value_mask, request.multi_modal_inputs)
        if request.minibatches == 1:
            steps = [self.critic.update(batch)]
        else:
            lengths = request.attention_mask.sum(1).tolist()
            steps = [self.critic.update(batch.select(rows)) for rows in minibatch_groups(lengths, request.minibatches)]
        self.version += 1
        self.metrics.set(version=self.version)
        metrics = {name: sum(float(step[name]) for step in steps) / len(steps) for name in steps[0]}
        self.last_metrics = {name: finite_or_none(value) for name, value in metrics.items()}
        return {"request_id": request.request_id, "version": self.version,
                "metrics": {name: finite_or_none(value) for name, value in metrics.items()}}

    def set_version(self, version: int) -> None:
        """AReaL's set_version: the version from now on, never lower than it is (ValueError); a higher one
        is made durable at once by a checkpoint under it (the journal's versions continue from it)."""
        if version < self.version:
            raise RequestError("args[0]", f"version {version} is lower than the critic's {self.version}: versions "
                                          f"only go forward", 409)
        if version > self.version:
            self.version = version
            self.metrics.set(version=self.version)
            self._checkpoint()

    def _journal(self, request: UpdateRequest, answer: dict) -> bool:
        """The update on disk before its answer: in the journal (True), or else in a checkpoint (False), or
        else the service stops (ServiceBroken) without answering it."""
        try:
            self.journal.append(request.to_json(), request.digest, answer)
            return True
        except OSError as err:
            journal_error = err
        self.ledger.record(request.request_id, request.digest, answer)  # the checkpoint's ledger holds it
        try:
            directory = self._checkpoint()
        except Exception as err:  # noqa: BLE001 - any failure leaves the update unrecorded
            raise ServiceBroken(
                f"update {request.request_id!r} was applied (version {self.version}) but neither the journal "
                f"({journal_error}) nor a checkpoint ({type(err).__name__}: {err}) could record it: it is not "
                f"answered, and its retry after the restart applies it once (free the disk first)") from err
        self.say(f"warning: the journal could not be written ({journal_error}); update {request.request_id!r} is "
                 f"recorded in checkpoint {directory} instead")
        return False

    # -- checkpoints ----------------------------------------------------------------------------------
    def _checkpoint(self) -> str:
        """The run's checkpoint step_<version> with the ledger, marked latest, older ones pruned, the
        journal emptied."""
        directory = checkpoints.step_dir(self.checkpoint_root, self.version)
        self._write(directory)
        checkpoints.mark_latest(self.checkpoint_root, directory)
        checkpoints.prune(self.checkpoint_root, keep_last=self.keep_last)
        self.journal.clear()
        self._unsaved = 0
        self.say(f"checkpoint saved: {directory} (version {self.version})")
        return directory

    def _write(self, directory: str) -> None:
        extra_state = {**self.position, "global_step": self.version, LEDGER_KEY: self.ledger.entries()}
        self.critic.save_checkpoint(directory, extra_state)

    def save(self, path: str | None) -> dict:
        """An admin save: the run's next checkpoint, or one at `path` (check_save_path's rules)."""
        if path is None:
            return {"path": self._checkpoint(), "version": self.version}
        directory = check_save_path(path, self.checkpoint_root)
        try:
            self._write(directory)
        except OSError as err:
            if checkpoints.caused_by_full_disk(err):
                raise
            raise RequestError("path", f"{directory} cannot be written: {err}") from None
        self.say(f"checkpoint saved: {directory} (version {self.version})")
        return {"path": directory, "version": self.version}

    def restore(self, path: str) -> None:
        """The weights, version and ledger of a checkpoint (a training run's: its data position kept). The
        version is the service's (global_step: its updates and set_version's), else the critic's steps."""
        state = dict(self.critic.load_checkpoint(path))
        self.ledger = Ledger(state.pop(LEDGER_KEY, None))
        state.pop(checkpoints.EXTRA_TENSORS, None)
        self.position = state
        self.version = int(state.get("global_step", self.critic.version))
        self.metrics.set(version=self.version)

    def load(self, path: str) -> dict:
        self.restore(path)
        # The journal's updates were applied to the state just replaced: a restart must start from this
        # one, so it becomes the latest checkpoint; the run's checkpoints at or past its version belong to
        # the line of updates it replaced, so they move aside (kept) rather than outrank it.
        self._supersede_from(self.version)
        self._checkpoint()
        return {"path": os.path.abspath(path), "version": self.version}

    def _supersede_from(self, version: int) -> None:
        later = [path for path in checkpoints.complete_checkpoints(self.checkpoint_root)
                 if int(os.path.basename(path).rpartition("_")[2]) >= version]
        if later:
            aside = tempfile.mkdtemp(prefix=time.strftime(f"{SUPERSEDED}%Y%m%dT%H%M%S-"), dir=self.checkpoint_root)
            for path in later:
                shutil.move(path, os.path.join(aside, os.path.basename(path)))
            self.say(f"{len(later)} checkpoint(s) past the loaded version {version} moved to {aside}")
        # The sets of superseded checkpoints are kept as the run's checkpoints are: the newest keep_last.
        sets = sorted((name for name in os.listdir(self.checkpoint_root) if name.startswith(SUPERSEDED)),
                      key=lambda name: os.path.getmtime(os.path.join(self.checkpoint_root, name)))
        for name in sets[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.checkpoint_root, name), ignore_errors=True)

    # -- a start, a restart -------------------------------------------------------------------------------
    def start_fresh(self) -> None:
        """A new run's first checkpoint, before any update: the base every journal continues. A restart
        then loads the state the first update met, whatever an engine's first save does to it (an FSDP2
        engine's initialises its optimizer state: torch's get_state_dict takes a zero-gradient step)."""
        self._checkpoint()

    def resume(self, parse) -> None:
        """The last checkpoint (weights, ledger), then the journal's updates past it, in order.
        parse(body) -> UpdateRequest: the schema's, so the digests are today's canonical ones."""
        latest = checkpoints.find_latest(self.checkpoint_root)
        if latest is not None:
            self.restore(latest)
            self.say(f"resumed from {latest} at version {self.version} ({len(self.ledger)} update answers kept)")
        applied = 0
        for entry in self.journal.recover(self.say):
            if entry["answer"]["version"] <= self.version:  # in the checkpoint already
                continue
            request = parse(entry["body"])
            answer = self._apply(request)
            if answer["version"] != entry["answer"]["version"]:
                raise ValueError(f"the journal's update {request.request_id!r} was answered at version "
                                 f"{entry['answer']['version']} but applies at {answer['version']}: the journal does "
                                 f"not continue the checkpoint; move {self.journal.path} away to serve the checkpoint "
                                 f"as it is")
            self.ledger.record(request.request_id, request.digest, entry["answer"])  # the first answer
            applied += 1
        self._unsaved = applied
        if applied:
            self.say(f"applied the journal's {applied} update(s) after the checkpoint again: version {self.version}")


def minibatch_groups(lengths: list[int], groups: int) -> list[list[int]]:
    """The rows of each of AReaL's `groups` mini-batches (areal.utils.data.split_padded_tensor_dict_into_mb_list
    with MicroBatchSpec(n_mbs=groups), its first-fit-decreasing allocation without a token cap): rows by
    length, longest first; the first `groups` open a group each, every later row joins the group with
    the fewest rows (ties: the fewest tokens, then the earliest); each group's rows in order, the
    groups by their first row."""
    order = numpy.argsort(-numpy.asarray(lengths))  # numpy's sort, as AReaL's: the same order among equal lengths
    members: list[list[int]] = []
    totals: list[tuple[float, int]] = []  # (tokens, group) kept sorted, as AReaL keeps them
    for row in order.tolist():
        if len(members) < groups:
            totals.append((float(lengths[row]), len(members)))
            members.append([row])
        else:
            pick = min(range(len(totals)), key=lambda i: (len(members[totals[i][1]]), i))
            tokens, group = totals.pop(pick)
            totals.append((tokens + lengths[row], group))
            members[group].append(row)
        totals.sort()
    return sorted(sorted(group) for group in members)


def check_save_path(path: str, checkpoint_root: str) -> str:
    """The absolute directory an admin save may write, or RequestError naming the path and the rule: a
    new directory (or an empty one), or a critic checkpoint's (critic_checkpoint.json, which it then
    replaces), outside the run's own checkpoints; never a file or a directory of anything else."""
    directory, root = os.path.abspath(path), os.path.abspath(checkpoint_root)
    rule = ("a save writes a new directory or over a critic checkpoint (one holding "
            f"{checkpoints.META_FILE}), nothing else")
    if directory == root or directory.startswith(root + os.sep):
        raise RequestError("path", f"{directory} is inside the run's checkpoints ({root}), which the service names "
                                   f"and prunes itself: POST /v1/save {{}} writes the run's next one; choose a path "
                                   f"outside it", 409)
    if os.path.islink(directory) or (os.path.exists(directory) and not os.path.isdir(directory)):
        raise RequestError("path", f"{directory} exists and is not a directory: {rule}", 409)
    if os.path.isdir(directory) and os.listdir(directory) \
            and not os.path.isfile(os.path.join(directory, checkpoints.META_FILE)):
        raise RequestError("path", f"{directory} holds files that are not a critic checkpoint, which are never "
                                   f"replaced: {rule}; choose a new directory", 409)
    reason = unwritable_reason(os.path.dirname(directory))
    if reason:
        raise RequestError("path", f"{directory} cannot be written: {reason}")
    return directory
