"""torchrun worker for test_transforms: an FSDP engine with transforms, on 1 or 2 ranks.

  python -m critic_adapters.tests.transform_worker MODEL_DIR (WORKDIR TRANSFORM[,TRANSFORM...] BACKEND)...
One run per group, one after another in this process.
Rank 0 writes WORKDIR/result.pt: optimizer parameter count, trainable names, parameters before and
after one update (full tensors), the fingerprint, the engine's values; the HF export goes to
WORKDIR/hf_export.
"""

import os
import sys
import warnings

import torch
from torch.distributed.tensor import DTensor

from critic_adapters.common.engine.config import EngineConfig, ModelConfig, OptimConfig
from critic_adapters.common.parallel.distributed import all_gather_object, init_distributed, shutdown
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.tests.conformance.worker import rollout
from critic_adapters.tests.transforms_for_tests import register_test_transforms


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main():
    warnings.filterwarnings("ignore")
    model_dir, runs = sys.argv[1], sys.argv[2:]
    register_test_transforms()
    dist = init_distributed()
    for start in range(0, len(runs), 3):
        workdir, names, backend = runs[start:start + 3]
        run(dist, model_dir, workdir, names.split(","), backend)
    shutdown()


def run(dist, model_dir: str, workdir: str, names: list[str], backend: str) -> None:
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-2), transforms=names)
    engine = build_engine(backend, config, dist)
    before = parameters(engine)
    engine.update(rollout(dist.rank))
    after = parameters(engine)
    values = engine.compute_values(rollout(dist.rank).input_ids, rollout(dist.rank).attention_mask)
    engine.export_hf(os.path.join(workdir, "hf_export"))
    finish(engine, dist, workdir, {"before": before, "after": after, "values": values}, leave=False)


def parameters(engine) -> dict:
    """Full copies of every parameter (gathered from the shards), by name."""
    return {n: full(p) for n, p in engine.model.named_parameters()}


def optimized_count(engine) -> int:
    """How many of this rank's model parameters the optimizer steps. megatron's distributed optimizer
    (its default) holds each data-parallel rank's slice of them (model_param_group_index_map: the
    model parameters with a range on this rank), so those are counted by name over the data-parallel
    group (pipeline stages and tensor ranks hold other parameters)."""
    parts = getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]
    index_maps = [getattr(part, "model_param_group_index_map", None) for part in parts]
    if any(index_map is None for index_map in index_maps):
        return sum(len(g["params"]) for g in engine.optimizer.param_groups)
    names = {id(p): name for name, p in engine.model.named_parameters()}
    mine = sorted({names[id(p)] for index_map in index_maps for p in index_map})
    return len(set().union(*all_gather_object(mine, group=engine.dp_group)))


def finish(engine, dist, workdir: str, result: dict, *, leave: bool = True) -> None:
    """Add what the optimizer steps, the trainable names and the fingerprint; close the engine; rank 0
    writes WORKDIR/result.pt; leave the process group (unless `leave` is false: more runs follow)."""
    result.update(optimized=optimized_count(engine),
                  trainable=sorted(n for n, p in engine.model.named_parameters() if p.requires_grad),
                  fingerprint=engine.fingerprint)
    engine.close()
    if dist.is_main:
        torch.save(result, os.path.join(workdir, "result.pt"))
    if leave:
        shutdown()


if __name__ == "__main__":
    main()
