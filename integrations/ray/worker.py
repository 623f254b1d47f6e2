"""One Ray actor = one rank of a critic engine: it joins the torch.distributed group the driver's
RayCriticGroup hands it (rank, world size, rendezvous address) and builds the engine there.

The actor selects its own rows of what it is given (its data-parallel share, balanced by tokens as
the torchrun trainer shares them: common.parallel.batching.data_parallel_shares), so a stack can pass a rollout batch as one Ray object reference that
every actor reads from the object store, without a copy through the driver per actor. A vision
critic's rows carry their images (multi_modal_inputs, one dict or None per row): a share takes its
rows' images with them, and its image patches count as tokens in the balance (the vision tower
encodes every one).
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch

from ...common.parallel.batching import data_parallel_shares


@contextlib.contextmanager
def _named_by_caller(rows: torch.Tensor):
    """A row's problem, which the engine names by its index in this share, named by the caller's index."""
    try:
        yield
    except _multimodal().RowError as error:
        raise error.in_rows(rows) from None


def _multimodal():
    """common.valuehead.multimodal, imported on first use: importing the package stays free of transformers."""
    from ...common.valuehead import multimodal

    return multimodal


class CriticWorker:
    """The actor's class (RayCriticGroup wraps it with ray.remote)."""

    def __init__(self, rank: int, world_size: int, threads: int):
        self.rank, self.world_size = rank, world_size
        # Ray starts actors with OMP_NUM_THREADS=1; the engine gets the CPUs it was given.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self.engine = None
        self.dist = None

    def where(self) -> dict:
        """This actor's pid, its Ray node, and an address + free port the group's rendezvous can use
        (rank 0's): the address Ray reports for the actor's node (127.0.0.1 on a local cluster)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return {"pid": os.getpid(), "host": host, "port": port, "node_id": ray.get_runtime_context().get_node_id()}

    def build(self, backend: str, config, master_addr: str, master_port: int) -> dict:
        """Join the group and build the engine; returns the engine's coordinates (and, on rank 0, its
        load report and parameter counts)."""
        from ...common.parallel.distributed import init_distributed
        from ...common.engine.registry import build_engine

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")  # Ray gives each actor its own devices
        self.dist = init_distributed(timeout_s=config.collective_timeout_s)
        self.engine = build_engine(backend, config, self.dist)
        info = {"dp_rank": self.engine.dp_rank, "dp_size": self.engine.dp_size}
        if self.rank == 0:
            info["load_report"] = self.engine.load_report
            info["counts"] = self.engine.parameter_counts()
        return info

    def _rows(self, attention_mask: torch.Tensor, images: tuple | None = None) -> torch.Tensor:
        """This data-parallel rank's rows, balanced by tokens as the trainer shares them (a row's
        image patches counted as tokens)."""
        patches = _multimodal().vision_patches(images, attention_mask.shape[0])
        return data_parallel_shares(attention_mask, self.engine.dp_size, patches)[self.engine.dp_rank]

    def _share(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, multi_modal_inputs) -> tuple:
        """(row indices, their input_ids, attention_mask and images) of this data-parallel share."""
        multimodal = _multimodal()
        images = multimodal.as_rows(multi_modal_inputs, input_ids.shape[0])
        rows = self._rows(attention_mask, images)
        return rows, input_ids[rows], attention_mask[rows], multimodal.select(images, rows)

    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, multi_modal_inputs=None) -> tuple:
        """(this data-parallel share's row indices, their values [rows, T])."""
        rows, *share = self._share(input_ids, attention_mask, multi_modal_inputs)
        with _named_by_caller(rows):
            return rows, self.engine.compute_values(*share)

    def update(self, batch) -> dict:
        rows = self._rows(batch.attention_mask, batch.multi_modal_inputs)
        with _named_by_caller(rows):
            return self.engine.update(batch.select(rows))

    def forward_backward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_fn=None,
                         multi_modal_inputs=None) -> tuple:
        """(this data-parallel share's row indices, their values, the loss or None): the engine's
        forward_backward on the share, `loss_fn` called on the share's values."""
        rows, ids, mask, images = self._share(input_ids, attention_mask, multi_modal_inputs)
        with _named_by_caller(rows):
            values, loss = self.engine.forward_backward(ids, mask, loss_fn, images)
        # On the CPU: the driver may have no device (the engine returns them detached).
        return rows, values.cpu(), None if loss is None else loss.cpu()

    def step_optimizer(self) -> float:
        return self.engine.step_optimizer()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def step_scheduler(self) -> list[float]:
        self.engine.scheduler.step()
        return self.engine.scheduler.get_last_lr()

    def last_lr(self) -> list[float]:
        return self.engine.scheduler.get_last_lr()

    def offload(self, model: bool, optimizer: bool, grads: bool) -> None:
        self.engine.offload(model=model, optimizer=optimizer, grads=grads)

    def onload(self, model: bool, optimizer: bool, grads: bool) -> None:
        self.engine.onload(model=model, optimizer=optimizer, grads=grads)

    def offloaded(self) -> frozenset:
        return self.engine.offloaded

    def resident_bytes(self) -> dict[str, int]:
        return self.engine.resident_bytes()

    def checkpoint_bytes(self) -> int:
        return self.engine.checkpoint_bytes()

    def save_checkpoint(self, directory: str, extra_state: dict, extra_tensors: dict | None = None) -> None:
        self.engine.save_checkpoint(directory, extra_state, extra_tensors)

    def version(self) -> int:
        return self.engine.version

    def load_checkpoint(self, directory: str) -> dict:
        return self.engine.load_checkpoint(directory)

    def export_hf(self, directory: str, max_shard_size: int | str) -> None:
        self.engine.export_hf(directory, max_shard_size=max_shard_size)

    def export_adapter(self, directory: str) -> None:
        self.engine.export_adapter(directory)

    def close(self) -> None:
        """Close the engine and leave the process group (the actor is killed after)."""
        from ...common.parallel.distributed import shutdown

        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.dist is not None:
            shutdown()
            self.dist = None
