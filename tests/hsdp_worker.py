"""torchrun worker (4 processes) for test_hsdp: hybrid sharding (engine.parallel.replicate=2: two
replicas, each sharding the critic over 2 ranks) against plain FSDP over the same 4 data-parallel
ranks, on one backend.

  python -m critic_adapters.tests.hsdp_worker BACKEND MODEL_DIR OUT_DIR

Per layout: values, one update (its metrics), values after it, a checkpoint; then each layout
loads the other's checkpoint (resuming across replicate degrees) and takes one more update. Then,
HSDP with three micro-batches a step, the gradient collectives of an update with replicas reduced
once per step against one reducing after every micro-batch (reduction_runs). Each rank writes
OUT_DIR/rank<r>.pt.
"""

import contextlib
import dataclasses
import itertools
import os
import sys

import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from critic_adapters.common.engine import build_engine
from critic_adapters.common.engine.config import BatchingConfig, ParallelConfig
from critic_adapters.common.engine.update_step import StepStats
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.tests.conformance.worker import engine_config, planned, rollout

LAYOUTS = {"fsdp4": ParallelConfig(), "hsdp2x2": ParallelConfig(replicate=2)}


def placements(engine) -> dict:
    """The FSDP layout of one weight: its placements and this rank's rows of it."""
    weight = dict(engine.model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(weight, DTensor)
    return {"placements": [str(p) for p in weight.placements], "local_rows": weight.to_local().shape[0],
            "rows": weight.shape[0]}


@contextlib.contextmanager
def gradient_collectives(engine):
    """Counts, while open, FSDP2's gradient collectives (torch's fully_shard foreach_reduce): the
    all-reduces over this rank's replicate group (HSDP's cross-replica reduction) and the
    reduce-scatters over its shard group."""
    ranks = {"all_reduce": torch_dist.get_process_group_ranks(engine.parallel.replicate_group),
             "reduce_scatter_single": torch_dist.get_process_group_ranks(engine.shard_group)}
    originals = {name: getattr(torch_dist, name) for name in ranks}
    counts = dict.fromkeys(ranks, 0)

    def counting(name):
        def collective(*args, group=None, **kwargs):
            if group is not None and torch_dist.get_process_group_ranks(group) == ranks[name]:
                counts[name] += 1
            return originals[name](*args, group=group, **kwargs)
        return collective

    for name in ranks:
        setattr(torch_dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch_dist, name, original)


@contextlib.contextmanager
def patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def reduction_runs(backend: str, model_dir: str, dist) -> dict:
    """HSDP 2x2 with a micro-batch per row (three a step), each run from the loaded critic: "once",
    an update as the engine takes it (then one forward_backward's collectives); "each", the same
    update with FSDPModule.set_requires_all_reduce a no-op, so FSDP2 all-reduces after every
    micro-batch as it did before; "after_failure", the update after one that raised at its second
    micro-batch's loss. Per run: the gradient collectives, the metrics, the values after."""
    config = dataclasses.replace(engine_config(model_dir, LAYOUTS["hsdp2x2"]),
                                 batching=BatchingConfig(micro_batch_size=1))
    out = {}
    for name in ("once", "each", "after_failure"):
        engine = build_engine(backend, config, dist)
        batch = rollout(engine.dp_rank)
        out["units"] = sum(isinstance(module, FSDPModule) for module in engine.model.modules())
        if name == "after_failure":
            calls, loss = itertools.count(), StepStats.micro_batch_loss

            def failing(stats, *args, **kwargs):
                if next(calls) == 1:
                    raise RuntimeError("injected failure")
                return loss(stats, *args, **kwargs)

            with patched(StepStats, "micro_batch_loss", failing), contextlib.suppress(RuntimeError):
                engine.update(batch)
            assert next(calls) == 2, "the injected failure did not stop the step at its second micro-batch"
            engine.zero_grad()
        keep_every = patched(FSDPModule, "set_requires_all_reduce", lambda *args, **kwargs: None)
        with keep_every if name == "each" else contextlib.nullcontext(), gradient_collectives(engine) as counts:
            metrics = engine.update(batch)
        out[name] = {"counts": counts, "metrics": metrics,
                     "values_after": engine.compute_values(batch.input_ids, batch.attention_mask)}
        if name == "once":
            with gradient_collectives(engine) as counts:
                engine.forward_backward(batch.input_ids, batch.attention_mask, loss_fn=lambda values: values.sum())
            out["forward_backward"] = counts
        engine.close()
    return out


def main(backend: str, model_dir: str, out_dir: str) -> None:
    dist = init_distributed()
    out = {}
    for name, parallel in LAYOUTS.items():
        engine = build_engine(backend, engine_config(model_dir, parallel), dist)
        batch = rollout(engine.dp_rank)
        out[name] = {"dp": (engine.dp_rank, engine.dp_size), "layout": placements(engine),
                     "values_before": engine.compute_values(batch.input_ids, batch.attention_mask)}
        out[name]["metrics"] = engine.update(batch)
        out[name]["memory"] = {"planned": planned(backend, engine_config(model_dir, parallel), dist),
                               "resident": engine.resident_bytes()}
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
    out["reduction"] = reduction_runs(backend, model_dir, dist)
    torch.save(out, os.path.join(out_dir, f"rank{torch_dist.get_rank()}.pt"))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
