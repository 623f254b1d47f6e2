"""torchrun worker for test_optimizer_and_precision: megatron's distributed and plain optimizers in
fp32 and bf16 on the same batch, their checkpoints, and a load across the two.

  python -m critic_adapters.backends.megatron.tests.optimizer_worker MODEL_DIR BATCH.pt WORK_DIR

Engines one after another in these processes (each rank takes rows rank, rank + world, ...):
  fp32-distributed   the defaults: values, 2 updates, a checkpoint, 1 more update, values after
  fp32-plain         engine.optim.distributed_optimizer=false: values, 3 updates, values after;
                     then loading fp32-distributed's checkpoint (refused: the message)
  fp32-resumed       the defaults, from fp32-distributed's checkpoint: 1 update (the one the run
                     took after its save), values after
  bf16-distributed   engine.mixed_precision=bf16: as fp32-distributed, 5 updates in all
  bf16-resumed       bf16, from bf16-distributed's checkpoint: its 3 updates after the save, values after
  bf16-plain         bf16 with the plain optimizer: values, 5 updates
and the step in pieces (pieces-dp2, pieces-tp2-sp): forward_backward over the rows in one call,
and in two, each followed by step_optimizer (the grad norm, the values after).
Rank 0 writes {run: {"values", "metrics", "values_after", "optimizers", "dtypes", ...}} to
WORK_DIR/result.pt.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.engine import RolloutBatch, build_engine
from critic_adapters.common.engine.config import (BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig,
                                                  ParallelConfig)
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.storage.checkpoints import META_FILE
from critic_adapters.common.tests.helpers import FIELDS

RUNS = {  # name: (mixed_precision, distributed_optimizer, checkpoint it resumes from, updates before a save)
    "fp32-distributed": ("none", True, None, 2),
    "fp32-plain": ("none", False, None, None),
    "fp32-resumed": ("none", True, "fp32-distributed", None),
    "bf16-distributed": ("bf16", True, None, 2),
    "bf16-resumed": ("bf16", True, "bf16-distributed", None),
    "bf16-plain": ("bf16", False, None, None),
}
UPDATES = {"none": 3, "bf16": 5}


def optimizer_names(optimizer) -> list[str]:
    return [type(part).__name__ for part in getattr(optimizer, "chained_optimizers", [optimizer])]


PIECES = {"pieces-dp2": {}, "pieces-tp2-sp": {"tensor": 2, "sequence_parallel": True}}


def gathered(dist, data, mine, values) -> torch.Tensor:
    """Every rank's rows of `values`, on every rank."""
    shares = [None] * dist.world_size
    torch_dist.all_gather_object(shares, (mine, values))
    full = torch.zeros(data["input_ids"].shape)
    for index, part in shares:
        full[index] = part
    return full


def in_pieces(dist, model_dir: str, batch_file: str, parallel: dict) -> dict:
    """{calls: grad norm and values after} of forward_backward over this rank's rows in 1 and in 2
    calls, then step_optimizer; the loss sums over rows, so both take the same gradient."""
    data = torch.load(batch_file)
    out = {}
    for calls in (1, 2):
        config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3),
                              batching=BatchingConfig(micro_batch_tokens=48), parallel=ParallelConfig(**parallel))
        engine = build_engine("megatron", config, dist)
        mine = torch.arange(engine.dp_rank, data["input_ids"].shape[0], engine.dp_size)
        for part in torch.tensor_split(mine, calls):
            def loss_fn(values, part=part):
                return ((values - data["returns"][part]) ** 2 * data["response_mask"][part]).sum()

            engine.forward_backward(data["input_ids"][part], data["attention_mask"][part], loss_fn)
        grad_norm = engine.step_optimizer()
        after = gathered(dist, data, mine, engine.compute_values(data["input_ids"][mine], data["attention_mask"][mine]))
        out[calls] = {"grad_norm": grad_norm, "values_after": after}
        engine.close()
    return out


def one_run(dist, model_dir: str, batch_file: str, work: str, name: str) -> dict:
    mixed_precision, distributed, resume_from, save_after = RUNS[name]
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, weight_decay=0.01,
                                                                               distributed_optimizer=distributed),
                          loss=LossConfig(clip_range=0.2), batching=BatchingConfig(micro_batch_tokens=48),
                          mixed_precision=mixed_precision)
    engine = build_engine("megatron", config, dist)
    data = torch.load(batch_file)
    mine = torch.arange(engine.dp_rank, data["input_ids"].shape[0], engine.dp_size)
    batch = RolloutBatch(*(data[k][mine] for k in FIELDS))

    def values():
        return gathered(dist, data, mine, engine.compute_values(batch.input_ids, batch.attention_mask))

    out = {"optimizers": optimizer_names(engine.optimizer),
           "dtypes": sorted({str(p.dtype) for p in engine.model.parameters()})}
    if resume_from is not None:
        engine.load_checkpoint(os.path.join(work, resume_from))
        updates = UPDATES[mixed_precision] - RUNS[resume_from][3]  # the updates the saved run took after its save
    else:
        out["values"] = values()
        updates = UPDATES[mixed_precision]
    out["metrics"] = []
    for step in range(updates):
        if step == save_after:
            engine.save_checkpoint(os.path.join(work, name))
            with open(os.path.join(work, name, META_FILE)) as f:
                out["meta"] = json.load(f)
        out["metrics"].append(engine.update(batch))
    out["values_after"] = values()
    if name == "fp32-plain":
        try:
            engine.load_checkpoint(os.path.join(work, "fp32-distributed"))
        except ValueError as err:
            out["refused"] = str(err)
    engine.close()
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    model_dir, batch_file, work = sys.argv[1:4]
    dist = init_distributed()
    results = {name: one_run(dist, model_dir, batch_file, work, name) for name in RUNS}
    results.update({name: in_pieces(dist, model_dir, batch_file, parallel) for name, parallel in PIECES.items()})
    if dist.is_main:
        torch.save(results, os.path.join(work, "result.pt"))
    shutdown()


if __name__ == "__main__":
    main()
