"""Torchrun worker for test_engine_contract.

  python -m critic_adapters.backends.fsdp.tests.contract_worker train  RUN_DIR BACKEND [key=value ...]
      run the training job; BACKEND `one_dp_rank` makes every process the same single DP rank
      (what tensor-parallel peers are to the trainer)
"""

import sys

import torch.distributed as torch_dist

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.common.engine.mesh import DATA, ParallelMesh
from critic_adapters.common.engine.registry import BackendSpec, register_backend
from critic_adapters.common.engine.config import load_train_config
from critic_adapters.common.parallel.distributed import init_distributed, shutdown


class OneDPRankEngine(FSDPCriticEngine):
    """An FSDP engine alone in its data-parallel group, on every process: the processes are
    model-parallel peers of one DP rank, so they must all see every row and agree on every number."""

    def save_checkpoint(self, directory, extra_state=None, extra_tensors=None):
        # The peers hold identical copies: one writes them (two writers of one directory would race).
        if self.dist.is_main:
            super().save_checkpoint(directory, extra_state, extra_tensors)
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


def main():
    mode, *args = sys.argv[1:]
    if mode == "train":
        train(args[0], args[1], args[2:])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
