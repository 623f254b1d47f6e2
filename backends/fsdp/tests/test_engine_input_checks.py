"""The engine refuses token ids outside the vocabulary before touching weights or optimizer (padding
positions may hold anything). Non-finite returns in one rank's share of a 2-rank step are refused on
every rank, on every backend: tests/conformance."""

import pytest
import torch

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.common.engine.config import EngineConfig, ModelConfig
from critic_adapters.common.parallel.distributed import init_distributed
from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest


def test_ids_outside_the_vocabulary(tmp_path):
    engine = FSDPCriticEngine(EngineConfig(model=ModelConfig(path=save_tiny_causal_lm("qwen2", str(tmp_path)))),
                              init_distributed())
    ids = torch.tensor([[5, 6, 1000, 7]])
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 1000\).*got \[5, 1000\]"):
        engine.compute_values(ids, mask)
    response = torch.tensor([[0, 1, 1, 1]])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.update(RolloutBatch(ids, mask, response, torch.zeros(1, 4), torch.zeros(1, 4)))
    # Padding positions may hold anything, packed or padded.
    assert engine.compute_values(ids, torch.tensor([[1, 1, 0, 0]])).shape == (1, 4)
    engine.config.batching.packing = False
    assert engine.compute_values(ids, torch.tensor([[1, 1, 0, 0]])).shape == (1, 4)
    engine.close()


if __name__ == "__main__":
    run_pytest(__file__)
