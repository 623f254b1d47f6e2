"""Torchrun worker for test_precision_options: bf16 mixed precision + activation checkpointing.

  python -m critic_adapters.backends.fsdp.tests.options_worker MODEL_DIR BATCH.pt OUT.pt
"""

import sys
import warnings

import torch

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.backends.fsdp.tests.worker_common import gather_rows, rank_share
from critic_adapters.common.engine.config import EngineConfig, ModelConfig, OptimConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.valuehead.config import critic_head


def main():
    model_dir, batch_file, out_file = sys.argv[1:4]
    dist = init_distributed()
    data, mine, batch = rank_share(batch_file, dist)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = FSDPCriticEngine(EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3),
                                               mixed_precision="bf16", gradient_checkpointing=True,
                                               cpu_offload=True), dist)
    out["warnings"] = [str(w.message) for w in caught]
    head_inputs = []
    critic_head(engine.model).register_forward_hook(lambda m, i, o: head_inputs.append((i[0].dtype, o.dtype)))
    values = engine.compute_values(batch.input_ids, batch.attention_mask)
    out["values"] = gather_rows(dist, mine, values, data["input_ids"].shape)
    out["values_dtype"] = str(values.dtype)
    out["head_dtypes"] = [str(d) for d in head_inputs[0]]
    out["losses"] = [engine.update(batch)["value_loss"] for _ in range(6)]
    out["checkpointing"] = engine.model.is_gradient_checkpointing
    engine.close()
    if dist.is_main:
        torch.save(out, out_file)
    shutdown()


if __name__ == "__main__":
    main()
