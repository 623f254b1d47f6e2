"""Worker for test_memory_plan (one process): the activations the job plan counts for a micro-batch
(common.engine.memory.rank_memory) beside what a real update's forward saved for its backward
(bench/tensor_bytes.py's SavedForBackward), for one backend and family at several token budgets, with
and without gradient checkpointing.

  python -m critic_adapters.tests.memory_plan_worker BACKEND FAMILY WORKDIR OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

from critic_adapters.bench.tensor_bytes import SavedForBackward
from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig, TrainConfig
from critic_adapters.common.engine.memory import rank_memory
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.valuehead.load import load_critic

BUDGETS = (256, 1024, 4096)
ROW = 64


def main(backend: str, family: str, workdir: str, out: str) -> None:
    model_dir = save_tiny_causal_lm(family, os.path.join(workdir, family))
    critic_config = load_critic(model_dir)[0].config
    dist = init_distributed()
    results = []
    for checkpointing in (False, True):
        for tokens in BUDGETS:
            engine_config = EngineConfig(model=ModelConfig(path=model_dir), gradient_checkpointing=checkpointing,
                                         batching=BatchingConfig(micro_batch_tokens=tokens))
            engine = build_engine(backend, engine_config, dist)
            rows = tokens // ROW
            generator = torch.Generator().manual_seed(tokens)
            ids = torch.randint(1, critic_config.vocab_size, (rows, ROW), generator=generator)
            mask = torch.ones_like(ids)
            response = torch.zeros_like(ids)
            response[:, ROW // 2:] = 1
            with SavedForBackward(engine.model) as saved:
                engine.update(RolloutBatch(ids, mask, response, torch.zeros(rows, ROW), torch.rand(rows, ROW)))
            engine.close()
            planned = rank_memory(TrainConfig(backend=backend, engine=engine_config), critic_config, 1)
            results.append({"tokens": tokens, "checkpointing": checkpointing, "saved": saved.peak,
                            "planned": planned.activations})
    with open(out, "w") as f:
        json.dump(results, f)
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
