"""torchrun worker for test_moe: mixture-of-experts critics on every backend that takes them, at
several layouts, in one torchrun of 2 processes (engines one after another).

  python -m critic_adapters.tests.moe_worker RUNS_JSON
RUNS_JSON: {name: {"backend", "model", "parallel": {engine.parallel}, "router_aux_coef", "save": bool,
"resume": name of a saving run, "export": bool, "workdir"}}. Every data-parallel rank trains on its own rollout
(conformance.worker.rollout(dp_rank)). Rank 0 writes WORKDIR/result.pt: the values of each
data-parallel rank's rows before and after one update, its metrics; a saving run then saves a
checkpoint (WORKDIR/checkpoint) and records its next update and values; a resuming run loads the
named run's checkpoint first, and records the same; an exporting run writes WORKDIR/hf_export. A
training run also records the HF critic's parameters after its update (state_after).
"""

import json
import os
import sys
import warnings

import torch

from critic_adapters.common.engine.config import EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.common.parallel.distributed import all_gather_object, init_distributed, shutdown
from critic_adapters.tests.conformance.worker import rollout
from critic_adapters.tests.transform_worker import parameters

LR = 1e-2
# Adam's first step moves a weight by about LR * g / (|g| + eps): with the usual 1e-8, weights whose
# gradient is near 1e-8 (experts few tokens reach) turn float32 rounding into visible differences.
EPS = 1e-6


def engine_config(spec: dict) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=spec["model"]), optim=OptimConfig(lr=LR, eps=EPS),
                        loss=LossConfig(router_aux_coef=spec.get("router_aux_coef", 0.0)),
                        parallel=ParallelConfig(**spec.get("parallel", {})))


def by_data_rank(engine, values: torch.Tensor) -> dict[int, torch.Tensor]:
    """{data-parallel rank: its rows' values}, from every rank (model-parallel peers agree)."""
    return dict(all_gather_object((engine.parallel.dp_rank, values), group=engine.parallel.world_group))


def full_state(engine) -> dict | None:
    """The HF critic's parameters by name, whole, on rank 0 (megatron: its HF state dict)."""
    if hasattr(engine, "hf_state_dict"):
        return engine.hf_state_dict()
    return parameters(engine)


def main() -> None:
    warnings.filterwarnings("ignore")
    runs = json.loads(sys.argv[1])
    dist = init_distributed()
    for name, spec in runs.items():
        result = run(dist, spec, runs)
        if dist.is_main:
            torch.save(result, os.path.join(spec["workdir"], "result.pt"))
    shutdown()


def run(dist, spec: dict, runs: dict) -> dict:
    engine = build_engine(spec["backend"], engine_config(spec), dist)
    batch = rollout(engine.parallel.dp_rank)
    result = {"data_ranks": engine.data_parallel_ranks}
    if spec.get("resume"):
        engine.load_checkpoint(os.path.join(runs[spec["resume"]]["workdir"], "checkpoint"))
        result["resumed_values"] = by_data_rank(engine, engine.compute_values(batch.input_ids, batch.attention_mask))
        result["next_metrics"] = engine.update(batch)
        result["next_values"] = by_data_rank(engine, engine.compute_values(batch.input_ids, batch.attention_mask))
        engine.close()
        return result
    result["values_before"] = by_data_rank(engine, engine.compute_values(batch.input_ids, batch.attention_mask))
    result["metrics"] = engine.update(batch)
    result["state_after"] = full_state(engine)
    result["values_after"] = by_data_rank(engine, engine.compute_values(batch.input_ids, batch.attention_mask))
    if spec.get("export"):
        engine.export_hf(os.path.join(spec["workdir"], "hf_export"))
    if spec.get("save"):
        engine.save_checkpoint(os.path.join(spec["workdir"], "checkpoint"), {"step": 1})
        result["next_metrics"] = engine.update(batch)
        result["next_values"] = by_data_rank(engine, engine.compute_values(batch.input_ids, batch.attention_mask))
    engine.close()
    return result


if __name__ == "__main__":
    main()
