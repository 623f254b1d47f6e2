"""Torchrun worker for test_checkpoints: save on one world size, load on another, export to HF.

  python -m critic_adapters.backends.veomni.tests.checkpoint_worker train-save    MODEL_DIR BATCH.pt WORKDIR
  python -m critic_adapters.backends.veomni.tests.checkpoint_worker load-continue MODEL_DIR BATCH.pt WORKDIR
Rank 0 writes the values it sees to WORKDIR/<mode>-world<N>.pt.
"""

import dataclasses
import os
import sys

import torch

from critic_adapters.backends.veomni.tests.worker_common import gather_rows, quiet, rank_share
from critic_adapters.common.engine.config import EngineConfig, ModelConfig, OptimConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import build_engine


def offload_policies(model: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return sorted({type(g.offload_policy).__name__ for g in groups if g is not None})


def main():
    mode, model_dir, batch_file, workdir = sys.argv[1:5]
    dist = init_distributed()
    data, mine, batch = rank_share(batch_file, dist)
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, lr_schedule="cosine",
                                                                                warmup_steps=2, total_steps=10))
    with quiet():
        engine = build_engine("veomni", config, dist)
    shape = data["input_ids"].shape
    values = lambda: gather_rows(dist, mine, engine.compute_values(batch.input_ids, batch.attention_mask), shape)  # noqa: E731
    out = {}
    checkpoint = os.path.join(workdir, "checkpoint")
    if mode == "train-save":
        out["losses"] = [engine.update(batch)["value_loss"] for _ in range(3)]
        engine.save_checkpoint(checkpoint, {"position": 3})
        out["saved"] = values()
        engine.export_hf(os.path.join(workdir, "hf_export"))
        engine.update(batch)
        out["continued"] = values()
        engine.close()
        # engine.cpu_offload at 2 ranks, on CPU as on a GPU (issue 49: VeOmni ignored it on CPU): FSDP2's
        # CPUOffloadPolicy on every unit, and the same 3 steps to the same values.
        with quiet():
            engine = build_engine("veomni", dataclasses.replace(config, cpu_offload=True), dist)
        out["offload_policies"] = offload_policies(engine.model)
        out["offload_losses"] = [engine.update(batch)["value_loss"] for _ in range(3)]
        out["offload_values"] = values()
    elif mode == "load-continue":
        out["extra"] = engine.load_checkpoint(checkpoint)
        out["loaded"] = values()
        out["lr"] = engine.scheduler.get_last_lr()[0]
        engine.update(batch)
        out["continued"] = values()
    engine.close()
    if dist.is_main:
        torch.save(out, os.path.join(workdir, f"{mode}-world{dist.world_size}.pt"))
    shutdown()


if __name__ == "__main__":
    main()
