"""torchrun worker for test_hl_gauss: an HL-Gauss critic on one backend, on 1 or 2 ranks.

  python -m critic_adapters.tests.hl_gauss_worker MODEL_DIR (WORKDIR BACKEND TENSOR)...
One run per (WORKDIR, BACKEND, TENSOR) group, one after another in this process.
The engine starts from MODEL_DIR's scalar head (engine.model.init_from_scalar_head), so its head is
not trivial. Every data-parallel rank trains on its own rollout (conformance.worker.rollout). Rank 0
writes WORKDIR/result.pt: values right after building and after one update, that update's metrics,
the next update's metrics and values, and those of a second engine resumed from a checkpoint taken
after the first update; the HF export before the update goes to WORKDIR/export_before, after it to
WORKDIR/export_after; and what a scalar (mse) engine says when asked to load that checkpoint.
"""

import os
import sys
import warnings

from critic_adapters.common.engine.config import EngineConfig, HLGaussConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.tests.conformance.worker import rollout
from critic_adapters.tests.transform_worker import finish

SUPPORT = HLGaussConfig(num_bins=21, min_value=-3.0, max_value=3.0, sigma_ratio=0.75)
LR = 1e-2


def engine_config(model_dir: str, tensor: int = 1) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=model_dir, init_from_scalar_head=True), optim=OptimConfig(lr=LR),
                        loss=LossConfig(kind="hl_gauss", clip_range=None, hl_gauss=SUPPORT),
                        parallel=ParallelConfig(tensor=tensor))


def main():
    warnings.filterwarnings("ignore")
    model_dir, runs = sys.argv[1], sys.argv[2:]
    dist = init_distributed()
    for start in range(0, len(runs), 3):
        workdir, backend, tensor = runs[start:start + 3]
        run(dist, model_dir, workdir, backend, int(tensor))
    shutdown()


def run(dist, model_dir: str, workdir: str, backend: str, tensor: int) -> None:
    config = engine_config(model_dir, tensor)
    batch = rollout(dist.rank // tensor)  # one rollout per data-parallel rank
    engine = build_engine(backend, config, dist)
    values_before = engine.compute_values(batch.input_ids, batch.attention_mask)
    engine.export_hf(os.path.join(workdir, "export_before"))
    metrics = engine.update(batch)
    values_after = engine.compute_values(batch.input_ids, batch.attention_mask)
    engine.export_hf(os.path.join(workdir, "export_after"))
    checkpoint = os.path.join(workdir, "checkpoint")
    engine.save_checkpoint(checkpoint, {"step": 1})
    next_metrics = engine.update(batch)
    next_values = engine.compute_values(batch.input_ids, batch.attention_mask)
    resumed = build_engine(backend, config, dist)
    resumed.load_checkpoint(checkpoint)
    resumed_metrics = resumed.update(batch)
    resumed_values = resumed.compute_values(batch.input_ids, batch.attention_mask)
    resumed.close()
    # The same checkpoint under a scalar (mse) engine: refused, naming the keys.
    scalar = build_engine(backend, EngineConfig(model=ModelConfig(path=model_dir), parallel=config.parallel), dist)
    try:
        scalar.load_checkpoint(checkpoint)
        scalar_error = None
    except ValueError as err:
        scalar_error = str(err)
    scalar.close()
    finish(engine, dist, workdir, {"values_before": values_before, "values_after": values_after, "metrics": metrics,
                                   "next": (next_metrics, next_values), "resumed": (resumed_metrics, resumed_values),
                                   "scalar_error": scalar_error}, leave=False)


if __name__ == "__main__":
    main()
