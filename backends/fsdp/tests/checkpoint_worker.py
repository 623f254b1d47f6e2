"""Torchrun worker for test_checkpoints: save on one world size, load on another, export to HF.

  python -m critic_adapters.backends.fsdp.tests.checkpoint_worker train-save   MODEL_DIR BATCH.pt WORKDIR
  python -m critic_adapters.backends.fsdp.tests.checkpoint_worker load-continue MODEL_DIR BATCH.pt WORKDIR
  python -m critic_adapters.backends.fsdp.tests.checkpoint_worker load-other   OTHER_MODEL_DIR BATCH.pt WORKDIR
Rank 0 writes the values it sees to WORKDIR/<mode>-world<N>.pt. Several runs, separated by `+`, run
one after another in the same processes.
"""

import os
import sys

import torch

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.backends.fsdp.tests.worker_common import gather_rows, rank_share
from critic_adapters.common.engine.config import EngineConfig, ModelConfig, OptimConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.tests.torchrun import argv_runs


def main():
    dist = init_distributed()
    for run in argv_runs(sys.argv[1:]):
        one_run(dist, *run)
    shutdown()


def one_run(dist, mode: str, model_dir: str, batch_file: str, workdir: str) -> None:
    data, mine, batch = rank_share(batch_file, dist)
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, lr_schedule="cosine",
                                                                                warmup_steps=2, total_steps=10))
    engine = FSDPCriticEngine(config, dist)
    shape = data["input_ids"].shape
    values = lambda: gather_rows(dist, mine, engine.compute_values(batch.input_ids, batch.attention_mask), shape)  # noqa: E731
    out = {}
    checkpoint = os.path.join(workdir, "checkpoint")
    if mode == "train-save":
        for _ in range(3):
            engine.update(batch)
        engine.save_checkpoint(checkpoint, {"position": 3})
        out["saved"] = values()
        engine.export_hf(os.path.join(workdir, "hf_export"))
        engine.update(batch)
        out["continued"] = values()
    elif mode == "load-continue":
        out["extra"] = engine.load_checkpoint(checkpoint)
        out["loaded"] = values()
        out["lr"] = engine.scheduler.get_last_lr()[0]
        engine.update(batch)
        out["continued"] = values()
    elif mode == "load-other":
        try:
            engine.load_checkpoint(checkpoint)
        except ValueError as err:
            out["error"] = str(err)
    engine.close()
    if dist.is_main:
        torch.save(out, os.path.join(workdir, f"{mode}-world{dist.world_size}.pt"))


if __name__ == "__main__":
    main()
