"""torchrun worker: the megatron engine's values for several checkpoints under several parallel
layouts of the same process count.

argv: out_file layouts_json model_dir... ; layouts: {name: spec}, spec: tensor, pipeline,
sequence_parallel, packing, and "naive_qkv": true for the negative control (q, k, v concatenated
whole instead of per KV group, for that layout only). Engines are built one after another in the
same process (close() releases megatron's groups). Rank 0 writes {name: {model_dir: values [B, T]}}
for the batch of common.tests.helpers.padded_batch.
"""

import json
import sys
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import build_engine
from critic_adapters.common.tests.helpers import padded_batch


def main() -> None:
    warnings.filterwarnings("ignore")
    out_file, layouts, model_dirs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    dist = init_distributed()
    results = {name: layout_values(dist, spec, model_dirs) for name, spec in layouts.items()}
    if dist.is_main:
        torch.save(results, out_file)
    shutdown()


def layout_values(dist, spec: dict, model_dirs) -> dict:
    from critic_adapters.backends.megatron import convert

    fuse_qkv = convert._fuse_qkv
    if spec.get("naive_qkv"):
        convert._fuse_qkv = lambda q, k, v, shapes: torch.cat([q, k, v])[None]
    try:
        return {model_dir: model_values(dist, spec, model_dir) for model_dir in model_dirs}
    finally:
        convert._fuse_qkv = fuse_qkv


def model_values(dist, spec: dict, model_dir: str) -> torch.Tensor:
    ids, mask = padded_batch(seed=1, batch=4, length=11)
    config = EngineConfig(
        model=ModelConfig(path=model_dir),
        batching=BatchingConfig(packing=spec.get("packing", True), micro_batch_tokens=24),
        parallel=ParallelConfig(tensor=spec.get("tensor", 1), pipeline=spec.get("pipeline", 1),
                                sequence_parallel=spec.get("sequence_parallel", False)))
    engine = build_engine("megatron", config, dist)
    mine = torch.arange(engine.dp_rank, ids.shape[0], engine.dp_size)
    values = engine.compute_values(ids[mine], mask[mine])
    shares = [None] * dist.world_size
    torch_dist.all_gather_object(shares, (mine, values))
    full = torch.zeros(ids.shape)
    for index, part in shares:
        full[index] = part
    engine.close()
    return full


if __name__ == "__main__":
    main()
