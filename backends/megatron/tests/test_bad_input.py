"""Bad input to the megatron engine is a clear ValueError before any process-group work."""

import pytest
import torch
from megatron.core import parallel_state

from critic_adapters.backends.megatron.engine import MegatronCriticEngine
from critic_adapters.common.engine.config import EngineConfig, ModelConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import DistContext
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny_causal_lm("qwen2", str(tmp_path_factory.mktemp("m") / "qwen2"))


def build(path: str, world: int, **parallel):
    config = EngineConfig(model=ModelConfig(path=path), parallel=ParallelConfig(**parallel))
    return MegatronCriticEngine(config, DistContext(rank=0, world_size=world, local_rank=0, device=torch.device("cpu")))


@pytest.mark.parametrize("parallel, world, message", [
    ({"tensor": 3}, 3, r"engine.parallel.tensor=3 must divide the attention heads \(4\) and the key/value heads \(2\)"),
    ({"pipeline": 4}, 4, r"engine.parallel.pipeline=4 is more than the model's 2 layers"),
    ({"sequence_parallel": True}, 1, r"sequence_parallel=true needs engine.parallel.tensor > 1"),
    ({"tensor": 2}, 3, r"world of 3 processes is not a multiple of engine.parallel.tensor \* pipeline \* context = 2"),
    ({"context": 2, "tensor": 2}, 2, r"tensor \* pipeline \* context = 4; launch a multiple of 4 processes"),
])
def test_bad_parallel_layout(qwen2, parallel, world, message):
    group_before = torch.distributed.is_initialized()  # another test in this process may have made one
    with pytest.raises(ValueError, match=message):
        build(qwen2, world, **parallel)
    assert torch.distributed.is_initialized() == group_before and not parallel_state.model_parallel_is_initialized()


def test_unsupported_family(tmp_path):
    path = save_tiny_causal_lm("gpt_neox", str(tmp_path / "neox"))
    group_before = torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"does not support model_type='gpt_neox'; supported: llama, mistral, qwen2"):
        build(path, 1)
    assert torch.distributed.is_initialized() == group_before and not parallel_state.model_parallel_is_initialized()


def test_a_vision_language_critic_is_refused_by_name_pointing_to_fsdp_and_veomni(tmp_path):
    path = save_tiny_causal_lm("qwen2_vl", str(tmp_path / "vlm"))
    with pytest.raises(ValueError, match=r"megatron backend has no vision-language critic \(qwen2_vl\).*"
                                         r"backend=fsdp or backend=veomni"):
        build(path, 1)


def test_parallel_degrees_must_be_positive():
    with pytest.raises(ValueError, match=r"engine.parallel.tensor=0 must be >= 1"):
        ParallelConfig(tensor=0)


if __name__ == "__main__":
    run_pytest(__file__)
