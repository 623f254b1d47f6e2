"""torchrun worker (4 processes) for test_hsdp: hybrid sharding (engine.parallel.replicate=2: two
replicas, each sharding the critic over 2 ranks) against plain FSDP over the same 4 data-parallel
ranks, on one backend.

  python -m critic_adapters.tests.hsdp_worker BACKEND MODEL_DIR OUT_DIR

Per layout: values, one update (its metrics), values after it, a checkpoint; then each layout
loads the other's checkpoint (resuming across replicate degrees) and takes one more update. Each
rank writes OUT_DIR/rank<r>.pt.
"""

import os
import sys

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from critic_adapters.common.engine import build_engine
from critic_adapters.common.engine.config import ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.tests.conformance.worker import engine_config, rollout

LAYOUTS = {"fsdp4": ParallelConfig(), "hsdp2x2": ParallelConfig(replicate=2)}


def placements(engine) -> dict:
    """The FSDP layout of one weight: its placements and this rank's rows of it."""
    weight = dict(engine.model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(weight, DTensor)
    return {"placements": [str(p) for p in weight.placements], "local_rows": weight.to_local().shape[0],
            "rows": weight.shape[0]}


def main(backend: str, model_dir: str, out_dir: str) -> None:
    dist = init_distributed()
    out = {}
    for name, parallel in LAYOUTS.items():
        engine = build_engine(backend, engine_config(model_dir, parallel), dist)
        batch = rollout(engine.dp_rank)
        out[name] = {"dp": (engine.dp_rank, engine.dp_size), "layout": placements(engine),
                     "values_before": engine.compute_values(batch.input_ids, batch.attention_mask)}
        out[name]["metrics"] = engine.update(batch)
        out[name]["values_after"] = engine.compute_values(batch.input_ids, batch.attention_mask)
        engine.save_checkpoint(os.path.join(out_dir, name))
        engine.export_hf(os.path.join(out_dir, f"{name}_export"))
        engine.close()
    for name, parallel in LAYOUTS.items():  # each resumes the other's checkpoint
        other = next(n for n in LAYOUTS if n != name)
        engine = build_engine(backend, engine_config(model_dir, parallel), dist)
        engine.load_checkpoint(os.path.join(out_dir, other))
        batch = rollout(engine.dp_rank)
        out[name]["values_resumed"] = engine.compute_values(batch.input_ids, batch.attention_mask)
        out[name]["metrics_resumed"] = engine.update(batch)
        engine.close()
    torch.save(out, os.path.join(out_dir, f"rank{torch_dist.get_rank()}.pt"))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
