"""Process-group setup and the few collectives the engines and trainer need, passed around explicitly.

Works the same under torchrun (env:// rendezvous) and in a plain single process (a world of one).
On GPU the default group has two backends, `cpu:gloo,cuda:nccl` (as torchtitan sets it up): the
few host-side numbers and objects exchanged here stay CPU tensors and go through gloo, while the
model's collectives run on NCCL. Every collective names its group explicitly.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, slots=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_backend() -> str:
    """gloo on CPU; with CUDA, gloo for CPU tensors and nccl for CUDA tensors in one group."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_distributed() -> DistContext:
    """Join (or create) the default process group (see process_group_backend)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # not under torchrun: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(process_group_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _world(group):
    return dist.group.WORLD if group is None else group


def _active(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(_world(group)) > 1


def all_reduce(values: list[float], op: str = "sum", group=None) -> list[float]:
    """Sum or max of a few numbers across the ranks of `group` (default: all), as a float64 CPU
    tensor (token counts stay exact; on GPU it goes through the group's gloo backend)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if _active(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=_world(group))
    return tensor.tolist()


def broadcast_object(obj, src: int = 0, group=None):
    """`obj` of the rank whose index within `group` is `src`, on every rank of the group."""
    if not _active(group):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(_world(group), src), group=_world(group))
    return holder[0]


def all_gather_object(obj, group=None) -> list:
    """Every rank's `obj`, in rank order."""
    if not _active(group):
        return [obj]
    gathered = [None] * dist.get_world_size(_world(group))
    dist.all_gather_object(gathered, obj, group=_world(group))
    return gathered


def barrier(group=None) -> None:
    """Wait for every rank of `group`; a CPU all-reduce, so it needs no device (gloo on any machine)."""
    if _active(group):
        dist.all_reduce(torch.zeros(1), group=_world(group))


def shutdown() -> None:
    """Leave the process group cleanly (after every engine is closed)."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()
