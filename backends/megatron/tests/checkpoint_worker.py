"""torchrun worker for checkpoint tests.

argv: mode model_dir batch_file work_dir tensor out_file [+ the same for another run ...] (the runs
one after another in these processes)
  save:   2 updates, checkpoint to work_dir/ckpt, 2 more updates, export to work_dir/hf_export
  resume: load work_dir/ckpt, 2 updates
Rank 0 writes {"metrics": [...], "weights": full HF state dict after the last update} to out_file.
"""

import os
import sys
import warnings

import torch

from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import RolloutBatch, build_engine

from critic_adapters.common.tests.helpers import FIELDS  # noqa: E402
from critic_adapters.common.tests.torchrun import argv_runs  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    dist = init_distributed()
    for run in argv_runs(sys.argv[1:]):
        one_run(dist, *run)
    shutdown()


def one_run(dist, mode: str, model_dir: str, batch_file: str, work_dir: str, tensor: str, out_file: str) -> None:
    config = EngineConfig(model=ModelConfig(path=model_dir),
                          optim=OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=1, total_steps=6),
                          loss=LossConfig(clip_range=0.2), batching=BatchingConfig(micro_batch_tokens=48),
                          parallel=ParallelConfig(tensor=int(tensor)))
    engine = build_engine("megatron", config, dist)
    data = torch.load(batch_file)
    mine = torch.arange(engine.dp_rank, data["input_ids"].shape[0], engine.dp_size)
    batch = RolloutBatch(*(data[k][mine] for k in FIELDS))
    ckpt = os.path.join(work_dir, "ckpt")
    metrics, heard = [], []
    if mode == "save":
        metrics += [engine.update(batch) for _ in range(2)]
        engine.save_checkpoint(ckpt, {"step": 2})
        metrics += [engine.update(batch) for _ in range(2)]
        engine.export_hf(os.path.join(work_dir, "hf_export"))
    else:
        with warnings.catch_warnings(record=True) as caught:  # what a user's load prints (issue 49)
            warnings.simplefilter("always")
            extra = engine.load_checkpoint(ckpt)
        heard = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
        assert extra == {"step": 2}, extra
        metrics += [engine.update(batch) for _ in range(2)]
    weights = engine.hf_state_dict()
    if dist.is_main:
        torch.save({"metrics": metrics, "weights": weights, "load_warnings": heard}, out_file)
    engine.close()


if __name__ == "__main__":
    main()
