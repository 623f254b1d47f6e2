"""Shared pieces of the VeOmni engine's torchrun test workers."""

import contextlib
import logging
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.parallel.distributed import DistContext
from critic_adapters.common.engine import RolloutBatch

from critic_adapters.common.tests.helpers import FIELDS  # noqa: E402


def make_batch(path: str) -> dict:
    """A saved mini-batch of 7 right-padded rows (lengths 4..20) with responses, old values and returns."""
    g = torch.Generator().manual_seed(0)
    lengths = [17, 9, 20, 4, 13, 11, 20]
    B, T = len(lengths), max(lengths)
    mask = torch.zeros(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        response[i, max(1, n // 3):n] = 1
    data = {"input_ids": torch.randint(3, 990, (B, T), generator=g) * mask, "attention_mask": mask,
            "response_mask": response, "old_values": torch.randn(B, T, generator=g) * 0.1 * response,
            "returns": torch.randn(B, T, generator=g) * response}
    torch.save(data, path)
    return data


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
