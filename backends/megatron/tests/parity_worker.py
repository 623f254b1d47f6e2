"""torchrun worker: values, then `steps` updates, of the megatron engine on a saved batch.

argv: model_dir batch_file out_file spec_json; spec: tensor, pipeline, sequence_parallel, packing,
steps, lr. Rank 0 writes {"values": [B, T], "metrics": [per step], "world": n} to out_file.
"""

import json
import sys
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import RolloutBatch, build_engine

from critic_adapters.common.tests.helpers import FIELDS  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    model_dir, batch_file, out_file, spec = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    dist = init_distributed()
    config = EngineConfig(
        model=ModelConfig(path=model_dir),
        optim=OptimConfig(lr=spec.get("lr", 1e-3), grad_clip=spec.get("grad_clip", 1.0)),
        loss=LossConfig(clip_range=0.2, agg_mode=spec.get("agg_mode", "token-mean")),
        batching=BatchingConfig(packing=spec.get("packing", True), micro_batch_tokens=spec.get("tokens", 48)),
        parallel=ParallelConfig(tensor=spec.get("tensor", 1), pipeline=spec.get("pipeline", 1),
                                sequence_parallel=spec.get("sequence_parallel", False)),
    )
    engine = build_engine("megatron", config, dist)
    data = torch.load(batch_file)
    mine = torch.arange(engine.dp_rank, data["input_ids"].shape[0], engine.dp_size)
    batch = RolloutBatch(*(data[k][mine] for k in FIELDS))
    values = engine.compute_values(batch.input_ids, batch.attention_mask)
    shares = [None] * dist.world_size
    torch_dist.all_gather_object(shares, (mine, values))
    full = torch.zeros(data["input_ids"].shape)
    for index, part in shares:
        full[index] = part
    metrics = [engine.update(batch) for _ in range(spec.get("steps", 1))]
    if dist.is_main:
        torch.save({"values": full, "metrics": metrics, "world": dist.world_size,
                    "layout": (engine.dp_size, config.parallel.tensor, config.parallel.pipeline)}, out_file)
    engine.close()
    shutdown()


if __name__ == "__main__":
    main()
