"""Torchrun worker for test_engine_parity: the engine's values, loss and full gradients on a fixed
batch, for several batching variants, written by rank 0 to OUT.

  python -m critic_adapters.backends.fsdp.tests.parity_worker MODEL_DIR BATCH.pt OUT.pt
"""

import sys

import torch
from torch.distributed.tensor import DTensor

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.backends.fsdp.tests.worker_common import full, gather_rows, rank_share
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig
from critic_adapters.common.parallel.distributed import all_reduce, init_distributed, shutdown

# name -> (batching, agg_mode); budgets small enough to force several micro-batches.
VARIANTS = {
    "packed-budget": (BatchingConfig(packing=True, micro_batch_tokens=40), "token-mean"),
    "padded-budget": (BatchingConfig(packing=False, micro_batch_tokens=40), "token-mean"),
    "packed-fixed": (BatchingConfig(packing=True, micro_batch_size=2), "token-mean"),
    "padded-fixed": (BatchingConfig(packing=False, micro_batch_size=3), "token-mean"),
    "packed-one-micro-batch": (BatchingConfig(packing=True, micro_batch_tokens=100000), "token-mean"),
    "packed-budget-seq-mean": (BatchingConfig(packing=True, micro_batch_tokens=40), "seq-mean-token-mean"),
    "padded-fixed-seq-mean": (BatchingConfig(packing=False, micro_batch_size=1), "seq-mean-token-mean"),
}


def main():
    model_dir, batch_file, out_file = sys.argv[1:4]
    dist = init_distributed()
    data, mine, batch = rank_share(batch_file, dist)
    results = {}
    for name, (batching, agg_mode) in VARIANTS.items():
        config = EngineConfig(model=ModelConfig(path=model_dir), batching=batching, optim=OptimConfig(lr=1e-3),
                              loss=LossConfig(clip_range=0.2, agg_mode=agg_mode))
        engine = FSDPCriticEngine(config, dist)
        values = gather_rows(dist, mine, engine.compute_values(batch.input_ids, batch.attention_mask),
                             data["input_ids"].shape)
        stats = engine.accumulate_gradients(batch)
        (loss,) = all_reduce([float(stats.sums[0])], group=engine.dp_group)
        grads = {n: full(p.grad) for n, p in engine.model.named_parameters()}
        results[name] = {"values": values, "loss": loss, "grads": grads, "agg_mode": agg_mode,
                         "attn": engine.load_report.attn_implementation,
                         "sharded": isinstance(next(engine.model.parameters()), DTensor)}
        engine.close()
    if dist.is_main:
        torch.save(results, out_file)
    shutdown()


if __name__ == "__main__":
    main()
