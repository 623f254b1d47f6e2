"""Torchrun worker: the VeOmni engine's values on a saved batch for one or more checkpoints.

  python -m critic_adapters.backends.veomni.tests.values_worker BATCH.pt OUT.pt MODEL_DIR [MODEL_DIR ...]
MODEL_DIR may carry options after '@': packing=false. Engines are built one after another in this
process (each closed before the next). Rank 0 writes {model_dir: {"values": [B, T] (all rows),
"critic_class", "report", "dropouts"} or {"error": message}} to OUT.pt.
"""

import os
import sys
import warnings

import torch

from critic_adapters.backends.veomni.tests.worker_common import gather_rows, quiet
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import build_engine


def process_state() -> dict:
    """What building an engine must leave as it was: the global RNG, warning filters, the environment,
    transformers' loss functions."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    return {"rng": torch.get_rng_state(), "warnings": list(warnings.filters), "environ": dict(os.environ),
            "loss_mapping": dict(LOSS_MAPPING)}


def _same(a, b) -> bool:
    return bool(torch.equal(a, b)) if torch.is_tensor(a) else a == b


def values_of(dist, model_spec: str, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    model_dir, _, options = model_spec.partition("@")
    packing = "packing=false" not in options
    mine = torch.arange(dist.rank, ids.shape[0], dist.world_size)
    config = EngineConfig(model=ModelConfig(path=model_dir),
                          batching=BatchingConfig(packing=packing, micro_batch_tokens=48))
    before = process_state()
    try:
        with quiet():
            engine = build_engine("veomni", config, dist)
    except ValueError as err:
        return {"error": str(err)}
    changed = [name for name, value in process_state().items() if not _same(value, before[name])]
    values = gather_rows(dist, mine, engine.compute_values(ids[mine], mask[mine]), ids.shape)
    cfg = engine.model.config
    out = {"values": values, "report": str(engine.load_report), "critic_class": type(engine.model).__name__,
           "changed_process_state": changed,
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
