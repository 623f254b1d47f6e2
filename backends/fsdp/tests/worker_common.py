"""Shared pieces of the torchrun test workers: each rank's share of a saved batch, and gathering."""

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from critic_adapters.common.parallel.distributed import DistContext
from critic_adapters.common.engine import RolloutBatch

from critic_adapters.common.tests.helpers import FIELDS  # noqa: E402


def rank_share(batch_file: str, dist: DistContext):
    """(full data dict, this rank's row indices, this rank's RolloutBatch): rows rank, rank+world, ..."""
    data = torch.load(batch_file)
    mine = torch.arange(dist.rank, data["input_ids"].shape[0], dist.world_size)
    return data, mine, RolloutBatch(*(data[k][mine] for k in FIELDS))


def gather_rows(dist: DistContext, mine: torch.Tensor, local: torch.Tensor, shape) -> torch.Tensor:
    """Reassemble per-rank rows into the full [B, T] tensor on every rank."""
    shares = [None] * dist.world_size
    torch_dist.all_gather_object(shares, (mine, local))
    out = torch.zeros(shape)
    for index, values in shares:
        out[index] = values
    return out


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from shards under FSDP (world > 1), as is on a single rank."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).clone()
