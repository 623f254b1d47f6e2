"""The engine's packed values equal plain unpacked compute_values, row by row, for every family
with a tiny config (mrope VLMs and soft-capped gemma2 included): packing never mixes sequences."""

import pytest
import torch

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig
from critic_adapters.common.parallel.distributed import init_distributed
from critic_adapters.common.parallel.packed_attention import ATTENTION_NAME
from critic_adapters.common.testdata import FAMILIES, save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic

LENGTHS = [6, 11, 3, 9, 11]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_packed_values_equal_each_row_alone(tmp_path, family):
    path = save_tiny_causal_lm(family, str(tmp_path / family))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 990, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = ids * mask
    # One micro-batch holds every row: a packed row of several sequences.
    config = EngineConfig(model=ModelConfig(path=path), batching=BatchingConfig(packing=True, micro_batch_tokens=4096))
    engine = FSDPCriticEngine(config, init_distributed())
    try:
        assert engine.load_report.attn_implementation == ATTENTION_NAME
        packed = engine.compute_values(ids, mask)
    finally:
        engine.close()
    plain, _ = load_critic(path, attn_implementation="eager")
    with torch.no_grad():
        for row, n in enumerate(LENGTHS):
            alone = compute_values(plain, ids[row:row + 1, :n], mask[row:row + 1, :n])[0]
            diff = float((packed[row, :n] - alone).abs().max())
            assert diff <= 2e-5, f"{family}: engine row {row} differs from the row alone by {diff:.3g}"


if __name__ == "__main__":
    run_pytest(__file__)
