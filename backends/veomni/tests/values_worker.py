"""Torchrun worker: the VeOmni engine's values on a saved batch for one or more checkpoints.

  python -m critic_adapters.backends.veomni.tests.values_worker BATCH.pt OUT.pt MODEL_DIR [MODEL_DIR ...]
MODEL_DIR may carry options after '@': packing=false. Engines are built one after another in this
process (each closed before the next). Rank 0 writes {model_dir: {"values": [B, T] (all rows),
"critic_class", "report", "dropouts"} or {"error": message}} to OUT.pt.
"""

import sys

import torch

from critic_adapters.backends.veomni.tests.worker_common import gather_rows, quiet
from critic_adapters.common.config import BatchingConfig, EngineConfig, ModelConfig
from critic_adapters.common.distributed import init_distributed, shutdown
from critic_adapters.common.engine import build_engine


def values_of(dist, model_spec: str, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    model_dir, _, options = model_spec.partition("@")
    packing = "packing=false" not in options
    mine = torch.arange(dist.rank, ids.shape[0], dist.world_size)
    config = EngineConfig(model=ModelConfig(path=model_dir),
                          batching=BatchingConfig(packing=packing, micro_batch_tokens=48))
    try:
        with quiet():
            engine = build_engine("veomni", config, dist)
    except ValueError as err:
        return {"error": str(err)}
    values = gather_rows(dist, mine, engine.compute_values(ids[mine], mask[mine]), ids.shape)
    cfg = engine.model.config
    out = {"values": values, "report": str(engine.load_report), "critic_class": type(engine.model).__name__,
           "dropouts": {k: getattr(cfg, k, None) for k in ("hidden_dropout", "classifier_dropout")}}
    engine.close()
    return out


def main():
    batch_file, out_file, *models = sys.argv[1:]
    dist = init_distributed()
    data = torch.load(batch_file)
    results = {spec: values_of(dist, spec, data["input_ids"], data["attention_mask"]) for spec in models}
    if dist.is_main:
        torch.save(results, out_file)
    shutdown()


if __name__ == "__main__":
    main()
