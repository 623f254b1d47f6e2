"""Process-group setup and the few collectives the engines and trainer need, passed around explicitly.

Works the same under torchrun (env:// rendezvous) and in a plain single process (a world of one),
with gloo on CPU and nccl on GPU.
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


def init_distributed() -> DistContext:
    """Join (or create) the default process group: gloo on CPU, nccl when CUDA is available."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # not under torchrun: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def all_reduce(values: list[float], op: str = "sum", device: torch.device | None = None) -> list[float]:
    """Sum or max of a few numbers across ranks (float64, so token counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device or "cpu")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """Leave the process group cleanly (after every engine is closed)."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()
