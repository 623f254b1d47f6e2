"""Torchrun worker for test_engine_contract.

  python -m critic_adapters.backends.fsdp.tests.contract_worker train  RUN_DIR BACKEND [key=value ...]
      run the training job; BACKEND `one_dp_rank` makes every process the same single DP rank
      (what tensor-parallel peers are to the trainer)
  python -m critic_adapters.backends.fsdp.tests.contract_worker sharded-load MODEL_DIR WORKDIR
      rank 1's added peak memory while the engine is built, and the engine's values
"""

import json
import os
import sys
import threading

import psutil
import torch
import torch.distributed as torch_dist

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.backends.fsdp.tests.worker_common import gather_rows
from critic_adapters.common.engine.mesh import DATA, ParallelMesh
from critic_adapters.common.engine.registry import BackendSpec, register_backend
from critic_adapters.common.engine.config import EngineConfig, ModelConfig, load_train_config
from critic_adapters.common.parallel.distributed import init_distributed, shutdown


class OneDPRankEngine(FSDPCriticEngine):
    """An FSDP engine alone in its data-parallel group, on every process: the processes are
    model-parallel peers of one DP rank, so they must all see every row and agree on every number."""

    def save_checkpoint(self, directory, extra_state=None):
        # The peers hold identical copies: one writes them (two writers of one directory would race).
        if self.dist.is_main:
            super().save_checkpoint(directory, extra_state)
        torch_dist.barrier()


def one_dp_rank(config, dist, mesh=None):
    groups = [torch_dist.new_group([rank]) for rank in range(dist.world_size)]  # collective: all ranks, same order
    return OneDPRankEngine(config, dist, mesh=ParallelMesh.from_groups(sizes={DATA: 1}, groups={DATA: groups[dist.rank]}))


def train(run_dir, backend, overrides):
    register_backend("one_dp_rank", BackendSpec(factory=f"{__name__}:one_dp_rank"), replace=True)
    from critic_adapters.common.job.trainer import run_training

    config = load_train_config([], [f"trainer.run_dir={run_dir}", f"backend={backend}", *overrides])
    dist = init_distributed()
    run_training(config, dist, say=lambda *a, **k: None)
    shutdown()


class PeakRSS:
    """Peak resident memory (mapped checkpoint pages included) above the start, sampled every 2 ms."""

    def __enter__(self):
        self._process = psutil.Process()
        self.base = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def added(self) -> int:
        return self.peak - self.base


def sharded_load(model_dir, workdir):
    dist = init_distributed()
    config = EngineConfig(model=ModelConfig(path=model_dir))
    torch_dist.barrier()
    with PeakRSS() as memory:
        engine = FSDPCriticEngine(config, dist)
        torch_dist.barrier()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30000, (4, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    mine = torch.arange(dist.rank, 4, dist.world_size)
    values = gather_rows(dist, mine, engine.compute_values(ids[mine], mask[mine]), ids.shape)
    with open(os.path.join(workdir, f"rank{dist.rank}.json"), "w") as f:
        json.dump({"added_rss": memory.added, "report": engine.load_report.format}, f)
    if dist.is_main:
        torch.save({"ids": ids, "mask": mask, "values": values}, os.path.join(workdir, "values.pt"))
    engine.close()
    shutdown()


def main():
    mode, *args = sys.argv[1:]
    if mode == "train":
        train(args[0], args[1], args[2:])
    elif mode == "sharded-load":
        sharded_load(*args)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
