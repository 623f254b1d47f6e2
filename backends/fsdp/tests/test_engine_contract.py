"""The engine contract (common/engine/__init__.py) as the FSDP engine implements it:
data-parallel coordinates drive sharding and normalisation; building an engine leaves the process
as it was; a save failing on one rank fails on all; rank 1 never holds the whole model while
loading; parallel degrees the backend lacks are refused by key."""

import os
import random
import warnings

import pytest
import torch

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.backends.fsdp.tests.launch import launch_in_process, run_torchrun
from critic_adapters.common.engine.config import EngineConfig, ModelConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed
from critic_adapters.common.engine import RolloutBatch, build_engine
from critic_adapters.common.job.metrics import read_metrics
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest

WORKER = "critic_adapters.backends.fsdp.tests.contract_worker"
SMALL_JOB = ["data.num_rollouts=48", "data.mini_batch_size=16", "trainer.epochs=1", "trainer.export_hf=false",
             "trainer.plot=false", "trainer.tensorboard=false", "trainer.progress=false",
             "engine.batching.micro_batch_tokens=256"]


def test_peers_of_one_data_parallel_rank_train_as_one_process(tmp_path):
    # Two processes that form one DP rank (as tensor-parallel peers do) must see every row and
    # normalise over that one rank: the same losses as a single process.
    single, peers = tmp_path / "single", tmp_path / "peers"
    run_torchrun(1, WORKER, "train", str(single), "fsdp", *SMALL_JOB, timeout=600)
    run_torchrun(2, WORKER, "train", str(peers), "one_dp_rank", *SMALL_JOB, timeout=600)
    expected = [r for r in read_metrics(str(single / "metrics.jsonl")) if r["split"] == "train"]
    got = [r for r in read_metrics(str(peers / "metrics.jsonl")) if r["split"] == "train"]
    assert len(got) == len(expected) == 3
    for a, b in zip(got, expected):
        assert a["value_loss"] == pytest.approx(b["value_loss"], abs=1e-6)
        assert a["valid_tokens"] == b["valid_tokens"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


# A save failing on one rank, NaN on one rank, clean export and resume: tests/conformance/, for every
# backend.


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 990, (3, 9), generator=g)
    response = torch.zeros_like(ids)
    response[:, 4:] = 1
    return RolloutBatch(ids, torch.ones_like(ids), response, torch.zeros(3, 9), torch.randn(3, 9, generator=g))


def _process_state():
    return (torch.get_rng_state(), random.getstate(), list(warnings.filters), dict(os.environ))


def test_building_and_using_an_engine_leaves_the_process_as_it_was(tmp_path):
    dist = init_distributed()
    config = EngineConfig(model=ModelConfig(path=save_tiny_causal_lm("qwen2", str(tmp_path / "m"))))
    build_engine("fsdp", config, dist).close()  # first use: lazy imports may add their own filters
    torch.manual_seed(1234)
    torch.rand(7)  # a state no seed reset reproduces
    random.seed(99)
    before = _process_state()
    engine = build_engine("fsdp", config, dist)
    engine.update(_batch())
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    torch.rand(3)  # the process draws on...
    drawn = _process_state()
    engine.load_checkpoint(str(tmp_path / "ckpt"))  # ...and loading must not rewind it
    engine.close()
    after = _process_state()
    assert not torch.equal(drawn[0], before[0])
    assert torch.equal(after[0], drawn[0]), "the process's torch RNG was reseeded or restored"
    assert after[1] == before[1], "python's random state changed"
    assert after[2] == before[2], "warning filters changed"
    assert after[3] == before[3], "os.environ changed"


def test_engine_rng_is_saved_and_restored_with_the_checkpoint(tmp_path):
    dist = init_distributed()
    config = EngineConfig(model=ModelConfig(path=save_tiny_causal_lm("qwen2", str(tmp_path / "m"))))
    engine = build_engine("fsdp", config, dist)
    torch.rand(5, generator=engine.generator)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    expected = torch.rand(5, generator=engine.generator)
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(torch.rand(5, generator=engine.generator), expected)
    engine.close()


@pytest.mark.parametrize("key,value", [("tensor", 2), ("pipeline", 2), ("context", 2)])
def test_parallel_degrees_fsdp_lacks_are_refused_by_key(tmp_path, key, value):
    config = EngineConfig(model=ModelConfig(path="unused"), parallel=ParallelConfig(**{key: value}))
    with pytest.raises(ValueError, match=rf"fsdp backend does not implement engine\.parallel\.{key}={value}"):
        FSDPCriticEngine(config, init_distributed())


def test_the_launcher_refuses_them_before_starting_any_process(tmp_path):
    run_dir = tmp_path / "run"
    result = launch_in_process("--nproc", "2", f"trainer.run_dir={run_dir}", "engine.parallel.pipeline=2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: the fsdp backend does not implement engine.parallel.pipeline=2 (offered by backend=megatron); "
        "it offers data parallel and engine.parallel.replicate, engine.parallel.ulysses: unset the key, or choose a backend that offers it"], \
        result.stderr
    assert not run_dir.exists()
    other = launch_in_process(f"trainer.run_dir={run_dir}", "backend=megatron", "--dry-run")
    assert other.returncode == 2 and "this is the fsdp launcher; run python -m critic_adapters.backends.megatron.train" \
        in other.stderr, other.stderr


def test_parallel_config_checks():
    with pytest.raises(ValueError, match="sequence_parallel=true needs engine.parallel.tensor > 1"):
        ParallelConfig(sequence_parallel=True)
    assert ParallelConfig(tensor=2, pipeline=2).data_parallel_size(8) == 2
    with pytest.raises(ValueError, match="cannot be split into groups of .* = 4"):
        ParallelConfig(tensor=2, pipeline=2).data_parallel_size(6)


if __name__ == "__main__":
    run_pytest(__file__)
