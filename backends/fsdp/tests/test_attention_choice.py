"""Which attention the FSDP2-based engines ask for (common.engine.fsdp2_core.attention_for): flash varlen
when it can run, else per-sequence sdpa."""

from critic_adapters.common.engine import fsdp2_core as engine
from critic_adapters.common.parallel import packed_attention
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig
from critic_adapters.common.tests.helpers import run_pytest


def config(packing=True, attn=None):
    return EngineConfig(model=ModelConfig(attn_implementation=attn), batching=BatchingConfig(packing=packing))


def test_packed_rows_use_flash_varlen_when_available(monkeypatch):
    monkeypatch.setattr(engine, "flash_attention_available", lambda: True)
    assert engine.attention_for(config()) == "flash_attention_2"


def test_packed_rows_fall_back_to_per_sequence_sdpa(monkeypatch):
    monkeypatch.setattr(engine, "flash_attention_available", lambda: False)
    assert engine.attention_for(config()) == packed_attention.ATTENTION_NAME


def test_padded_rows_leave_the_choice_to_the_loader_and_explicit_wins(monkeypatch):
    monkeypatch.setattr(engine, "flash_attention_available", lambda: True)
    assert engine.attention_for(config(packing=False)) is None  # load_critic: flash > sdpa > eager
    assert engine.attention_for(config(packing=False), padded="sdpa") == "sdpa"  # the veomni engine's choice
    assert engine.attention_for(config(attn="eager")) == "eager"


if __name__ == "__main__":
    run_pytest(__file__)
