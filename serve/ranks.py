"""The torchrun ranks behind the server: rank 0 serves and leads, every other rank follows.

Rank 0's engine thread sends each piece of work (values of a batch, an update, a save, a load,
offload / onload, stop) to all ranks in one broadcast over a group of its own, whose timeout is long:
a follower may wait hours for the next request (the engine's groups keep the job's bounded timeout for
the work itself). Every rank then does its part as the training job does: its data-parallel share of
the rows (balanced by tokens: common.parallel.batching.data_parallel_shares; model-parallel peers take
the same rows), values gathered back in row order over the data-parallel group. The work succeeds or
fails on every rank together (common.parallel.distributed.one_outcome): rank 0 answers the error, the
followers wait for the next piece.

RankZeroCritic is, on rank 0, the same driver-side surface as integrations.ray.RayCriticGroup
(compute_values of every row, update of a whole mini-batch, version, save / load, offload / onload,
lost, close), so the server drives either.

A rank that dies (killed, out of memory) is found by rank 0 at once: its collective with that rank
fails as the connection closes, and while rank 0 waits for the ranks' outcomes it watches the other
ranks' processes on its own machine (lost()), so it answers the request in flight, naming the rank,
instead of waiting out the collective timeout while torchrun ends the job.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket

import torch

from ..common.engine import RolloutBatch
from ..common.job.lifeline import is_gone, process_identity
from ..common.parallel.batching import data_parallel_shares
from ..common.parallel.distributed import all_gather_object, broadcast_object, one_outcome, world_group
from ..common.valuehead.multimodal import select, vision_patches

IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The command group's timeout: how long a follower waits for the next request."""


class LeaderGone(RuntimeError):
    """A follower lost rank 0 (it was killed, or stopped without saying so)."""


def command_group(world_size: int):
    """A gloo group over every rank for the commands (None in a world of one); made on every rank."""
    if world_size == 1:
        return None
    return torch.distributed.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def rank_processes(group) -> list[tuple[str, int, str | None]]:
    """(host, pid, process identity) of every rank, in rank order (collective over `group`, every rank)."""
    me = (socket.gethostname(), os.getpid(), process_identity(os.getpid()))
    return [me] if group is None else all_gather_object(me, group=group)


def close_command_group(group) -> None:
    """Destroy the command group (every rank, after the last command): its gloo threads end with it."""
    if group is not None:
        torch.distributed.destroy_process_group(group)


def _share(engine, attention_mask: torch.Tensor, images) -> torch.Tensor:
    patches = vision_patches(images, attention_mask.shape[0])
    return data_parallel_shares(attention_mask, engine.dp_size, patches)[engine.dp_rank]


def _values(engine, input_ids, attention_mask, images) -> tuple[torch.Tensor, int]:
    rows = _share(engine, attention_mask, images)
    values = engine.compute_values(input_ids[rows], attention_mask[rows], select(images, rows))
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    for index, share in all_gather_object((rows, values), group=engine.dp_group):
        out[index] = share
    return out, engine.version


def _update(engine, batch: RolloutBatch) -> dict:
    rows = _share(engine, batch.attention_mask, batch.multi_modal_inputs)
    return engine.update(batch.select(rows))


def run_command(engine, command: tuple):
    """One piece of work on this rank: every rank runs the same command."""
    op, *args = command
    if op == "values":
        return _values(engine, *args)
    if op == "update":
        return _update(engine, *args)
    if op == "save":
        directory, extra_state = args
        return engine.save_checkpoint(directory, extra_state)
    if op == "load":
        return engine.load_checkpoint(*args)
    if op == "offload":
        return engine.offload()
    if op == "onload":
        return engine.onload()
    raise ValueError(f"unknown command {op!r}")


def follow(engine, group, timeout_s: float, crash) -> None:
    """A follower's loop: every command rank 0 sends, until it says stop. SIGTERM and Ctrl-C are rank
    0's to act on (it drains, saves if asked, then says stop); a follower leaves only then, or when
    its launcher is gone (common.job.lifeline). `crash`: serve/crash_points.py."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            command = broadcast_object(None, src=0, group=group)
        except RuntimeError as err:  # rank 0's connection closed: it is gone, and with it the service
            raise LeaderGone(f"rank 0 is gone, so this rank stops ({err})") from None
        if command[0] == "stop":
            return
        crash.reach("follower-command")
        try:
            with one_outcome(f"serving {command[0]}", group=world_group(), timeout_s=timeout_s):
                run_command(engine, command)
        except Exception:  # noqa: BLE001 - rank 0 answers it; this rank waits for the next request
            continue


class RankZeroCritic:
    """Rank 0's handle on the engine of every rank (a world of one: the engine itself)."""

    def __init__(self, engine, group, timeout_s: float, processes: list[tuple[str, int, str | None]]):
        self.engine, self.group, self.timeout_s = engine, group, timeout_s
        self.processes = processes
        """rank_processes(): what lost() watches."""
        self.data_parallel_ranks = engine.data_parallel_ranks

    def _all(self, *command):
        if self.group is not None:
            broadcast_object(command, src=0, group=self.group)
        with one_outcome(f"serving {command[0]}", group=world_group(), timeout_s=self.timeout_s, lost=self.lost):
            return run_command(self.engine, command)

    def lost(self) -> str | None:
        """Why the ranks cannot answer any more (a rank's process on this machine has exited), or None.
        Ranks on other machines are not watched: their loss shows as the collective's error."""
        host = socket.gethostname()
        gone = [f"rank {rank} (pid {pid})" for rank, (where, pid, identity) in enumerate(self.processes)
                if rank > 0 and where == host and is_gone(pid, identity)]
        return f"{', '.join(gone)} of {len(self.processes)} exited" if gone else None

    @property
    def version(self) -> int:
        return self.engine.version

    def compute_values(self, input_ids, attention_mask, multi_modal_inputs=None, *, return_version: bool = False):
        values, version = self._all("values", input_ids, attention_mask, multi_modal_inputs)
        return (values, version) if return_version else values

    def update(self, batch: RolloutBatch) -> dict:
        return self._all("update", batch)

    def save_checkpoint(self, directory: str, extra_state: dict) -> None:
        self._all("save", directory, extra_state)

    def load_checkpoint(self, directory: str) -> dict:
        return self._all("load", directory)

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")

    @property
    def offloaded(self) -> frozenset:
        return self.engine.offloaded

    def close(self) -> None:
        """Tell the followers to stop (the engine itself is closed by whoever built it)."""
        if self.group is not None:
            broadcast_object(("stop",), src=0, group=self.group)
            close_command_group(self.group)
            self.group = None
