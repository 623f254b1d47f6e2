"""The engine refuses bad inputs on every rank at once, before touching weights or optimizer: token ids
outside the vocabulary, and non-finite returns in one rank's share of a 2-rank step."""

import pytest
import torch

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.common.config import EngineConfig, ModelConfig
from critic_adapters.common.distributed import init_distributed
from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.backends.fsdp.tests.launch import run_torchrun


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


def test_nan_returns_on_one_rank_raise_on_every_rank(tmp_path):
    # Before: the rank with the NaN raised inside its loss, the other entered backward's collectives
    # and gloo aborted the whole job.
    out = tmp_path / "result.pt"
    run_torchrun(2, "critic_adapters.backends.fsdp.tests.input_check_worker", save_tiny_causal_lm("qwen2", str(tmp_path / "m")),
                 str(out), timeout=300)
    results = torch.load(out)
    assert [r["raised_on"] for r in results] == [2.0, 2.0]
    assert "returns has 1 non-finite" in results[1]["error"] and "rollout data" in results[1]["error"]
    assert "another rank" in results[0]["error"]
    assert all(r["unchanged"] for r in results), "weights or optimizer state changed on a refused step"
    assert all(torch.isfinite(torch.tensor(r["next_loss"])) for r in results)


if __name__ == "__main__":
    run_pytest(__file__)
