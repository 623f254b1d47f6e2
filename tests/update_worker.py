"""torchrun worker: `steps` updates of one backend's engine on a saved batch (cross-backend tests).

argv: backend out_file spec_json model_dir batch_file; spec: tensor, pipeline, steps.
Rank 0 writes the per-step metrics to out_file.
"""

import json
import sys
import warnings

import torch

from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import RolloutBatch, build_engine
from critic_adapters.common.parallel.batching import data_parallel_shares

from critic_adapters.common.tests.helpers import FIELDS  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    backend, out_file, spec, model_dir, batch_file = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), *sys.argv[4:6]
    dist = init_distributed()
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, grad_clip=1.0),
                          loss=LossConfig(clip_range=0.2), batching=BatchingConfig(micro_batch_tokens=48),
                          parallel=ParallelConfig(tensor=spec.get("tensor", 1), pipeline=spec.get("pipeline", 1)))
    engine = build_engine(backend, config, dist)
    # The FSDP engine shards data over every rank; megatron over its data-parallel ranks.
    rank, size = (engine.dp_rank, engine.dp_size) if backend == "megatron" else (dist.rank, dist.world_size)
    data = torch.load(batch_file)
    mine = data_parallel_shares(data["attention_mask"], size)[rank]  # the trainer's and the Ray group's shares
    batch = RolloutBatch(*(data[k][mine] for k in FIELDS))
    metrics = [engine.update(batch) for _ in range(spec.get("steps", 1))]
    if dist.is_main:
        torch.save(metrics, out_file)
    engine.close()
    shutdown()


if __name__ == "__main__":
    main()
