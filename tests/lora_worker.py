"""torchrun worker for test_lora: a LoRA critic on the FSDP engine, on 1 or 2 ranks.

  python -m critic_adapters.tests.lora_worker MODEL_DIR (WORKDIR BACKEND TENSOR[sp] ADAPTER_DIR)...
One run per group of four, one after another in this process. TENSOR: engine.parallel.tensor
(megatron), "TxP" with pipeline P, an "sp" suffix for sequence parallel; ADAPTER_DIR:
engine.lora.adapter_path (a peft adapter to start from), "-" for none.
Every rank trains on its own rollout (conformance.worker.rollout(rank)). Rank 0 writes
WORKDIR/result.pt (transform_worker.finish): the values of the same engine without LoRA, right after
building and after one update, the update's metrics, the full parameters before and after, the
parameter counts; the adapter before the step goes to
WORKDIR/adapter_before, after it to WORKDIR/adapter_after, the merged critic to WORKDIR/hf_export,
a checkpoint after it to WORKDIR/checkpoint (and the next update of the engine and of a second
engine resumed from that checkpoint).
"""

import os
import sys
import warnings

import dataclasses

from critic_adapters.common.engine.config import EngineConfig, LoRAConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import all_gather_object, init_distributed, shutdown
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.tests.conformance.worker import planned, rollout
from critic_adapters.tests.transform_worker import finish
from critic_adapters.tests.transform_worker import parameters as module_parameters

LORA = LoRAConfig(rank=4, alpha=8.0)  # scale alpha / rank = 2: a wrong scale shows in the merged export
LR = 1e-2


def parameters(engine) -> dict:
    """Full copies of the HF critic's parameters by name (megatron: its HF state, on rank 0)."""
    if hasattr(engine, "hf_state_dict"):
        return engine.hf_state_dict()
    return module_parameters(engine)


def main():
    warnings.filterwarnings("ignore")
    model_dir, runs = sys.argv[1], sys.argv[2:]
    dist = init_distributed()
    for start in range(0, len(runs), 4):
        workdir, backend, layout, adapter = runs[start:start + 4]
        run(dist, model_dir, workdir, backend, layout, None if adapter == "-" else adapter)
    shutdown()


def run(dist, model_dir: str, workdir: str, backend: str, layout: str, adapter: str | None) -> None:
    tensor, _, pipeline = layout.removesuffix("sp").partition("x")
    parallel = ParallelConfig(tensor=int(tensor), pipeline=int(pipeline or 1), sequence_parallel=layout.endswith("sp"))
    lora = dataclasses.replace(LORA, adapter_path=adapter)
    batch = rollout(dist.rank // (parallel.tensor * parallel.pipeline))  # one rollout per data-parallel rank
    plain = build_engine(backend, EngineConfig(model=ModelConfig(path=model_dir), parallel=parallel), dist)
    values_plain = plain.compute_values(batch.input_ids, batch.attention_mask)  # the same critic, no LoRA
    plain.close()
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=LR), lora=lora, parallel=parallel)
    engine = build_engine(backend, config, dist)
    values_before = engine.compute_values(batch.input_ids, batch.attention_mask)
    engine.export_adapter(os.path.join(workdir, "adapter_before"))
    before = parameters(engine)
    metrics = engine.update(batch)
    memory = {"planned": planned(backend, config, dist), "resident": engine.resident_bytes()}
    after = parameters(engine)
    values_after = engine.compute_values(batch.input_ids, batch.attention_mask)
    engine.export_adapter(os.path.join(workdir, "adapter_after"))
    engine.export_hf(os.path.join(workdir, "hf_export"))
    # Resume: a second engine loads the checkpoint; its next update and values equal the first's.
    checkpoint = os.path.join(workdir, "checkpoint")
    engine.save_checkpoint(checkpoint, {"step": 1})
    checkpoint_bytes = engine.checkpoint_bytes()
    next_metrics = engine.update(batch)
    next_values = engine.compute_values(batch.input_ids, batch.attention_mask)
    resumed = build_engine(backend, config, dist)
    extra = resumed.load_checkpoint(checkpoint)
    resumed_metrics = resumed.update(batch)
    resumed_values = resumed.compute_values(batch.input_ids, batch.attention_mask)
    resumed.close()
    # Every stage's trainable names (a pipeline stage holds only its own layers, the last one the head).
    local = {name for name, p in engine.model.named_parameters() if p.requires_grad}
    trainable_all = sorted(set().union(*all_gather_object(local, group=engine.parallel.world_group)))
    finish(engine, dist, workdir, {"trainable_all": trainable_all,
        "values_plain": values_plain, "values_before": values_before, "values_after": values_after, "metrics": metrics,
        "before": before, "after": after, "counts": engine.parameter_counts(), "extra": extra,
        "checkpoint_bytes": checkpoint_bytes, "next": (next_metrics, next_values), "memory": memory,
        "resumed": (resumed_metrics, resumed_values)}, leave=False)


if __name__ == "__main__":
    main()
