"""Shared pieces of the VeOmni engine's torchrun test workers."""

import contextlib
import logging
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.distributed import DistContext
from critic_adapters.common.engine import RolloutBatch

FIELDS = ("input_ids", "attention_mask", "response_mask", "old_values", "returns")


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


@contextlib.contextmanager
def quiet():
    """VeOmni's INFO lines and library warnings off while a test worker builds an engine."""
    logger = logging.getLogger("veomni")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
