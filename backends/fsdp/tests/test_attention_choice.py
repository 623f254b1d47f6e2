"""Which attention the FSDP2-based engines ask for (common.engine.fsdp2_core.attention_for, deciding
through common.parallel.kernels): flash only where it computes (CUDA, bf16/fp16), torch's varlen
kernel for packed rows without flash_attn, else per-sequence sdpa; Ulysses and an explicit choice
win, a flash kernel asked for in fp32 is refused by name."""

import pytest
import torch

from critic_adapters.common.engine import fsdp2_core as engine
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig, compute_dtype
from critic_adapters.common.parallel import kernels, packed_attention, varlen_attention
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead.config import critic_config

QWEN2 = critic_config(tiny_config("qwen2"))
GPU_WITH_FLASH = kernels.Installed(cuda=True, flash_attn=True, torch_varlen=True, transformer_engine=False,
                                   liger_kernel=False)
GPU_WITHOUT_FLASH = kernels.Installed(cuda=True, flash_attn=False, torch_varlen=True, transformer_engine=False,
                                      liger_kernel=False)


def config(packing=True, attn=None, dtype="float32", mixed_precision="none"):
    return EngineConfig(model=ModelConfig(attn_implementation=attn, dtype=dtype), mixed_precision=mixed_precision,
                        batching=BatchingConfig(packing=packing))


def choose(cfg, have, critic=QWEN2):
    return engine.attention_for(cfg, critic, compute_dtype(cfg), have=have).kernel


def test_an_fp32_critic_never_gets_flash_even_where_it_is_installed():
    """Issue 41, item 1: fp32 (the default) + flash_attn installed + CUDA picked flash_attention_2 for
    packed rows, which crashes at the first forward (flash has fp16/bf16 kernels only)."""
    assert choose(config(), GPU_WITH_FLASH) == packed_attention.ATTENTION_NAME
    assert choose(config(packing=False), GPU_WITH_FLASH) == "sdpa"
    # bf16 compute, by bf16 parameters or bf16 mixed precision: flash's varlen kernel.
    assert choose(config(dtype="bfloat16"), GPU_WITH_FLASH) == "flash_attention_2"
    assert choose(config(mixed_precision="bf16"), GPU_WITH_FLASH) == "flash_attention_2"
    assert choose(config(packing=False, mixed_precision="bf16"), GPU_WITH_FLASH) == "flash_attention_2"
    # VeOmni at one rank ignores bf16 mixed precision: fp32 compute, no flash.
    one_rank = compute_dtype(config(mixed_precision="bf16"), mixed_precision_applies=False)
    assert engine.attention_for(config(mixed_precision="bf16"), QWEN2, one_rank, have=GPU_WITH_FLASH).kernel \
        == packed_attention.ATTENTION_NAME


def test_packed_bf16_rows_without_flash_attn_take_torchs_varlen_kernel():
    """Issue 41, item 12: torch's own varlen flash kernel when flash_attn is not installed."""
    assert choose(config(dtype="bfloat16"), GPU_WITHOUT_FLASH) == varlen_attention.ATTENTION_NAME
    gemma2 = critic_config(tiny_config("gemma2"))  # soft-capped logits: varlen_attn cannot
    assert choose(config(dtype="bfloat16"), GPU_WITHOUT_FLASH, gemma2) == packed_attention.ATTENTION_NAME
    no_cuda = kernels.Installed(cuda=False, flash_attn=False, torch_varlen=False, transformer_engine=False,
                                liger_kernel=False)
    assert choose(config(dtype="bfloat16"), no_cuda) == packed_attention.ATTENTION_NAME


def test_explicit_choices_win_and_flash_in_fp32_is_refused_by_name():
    assert choose(config(attn="eager"), GPU_WITH_FLASH) == "eager"
    assert choose(config(attn="flash_attention_2", dtype="bfloat16"), GPU_WITH_FLASH) == "flash_attention_2"
    with pytest.raises(ValueError, match="engine.model.attn_implementation=flash_attention_2 computes in bf16/fp16 "
                                         "only, and this critic computes in float32"):
        choose(config(attn="flash_attention_2"), GPU_WITH_FLASH)


def test_the_choice_on_this_machine_says_why():
    choice = engine.attention_for(config(), QWEN2, torch.float32)
    if not torch.cuda.is_available():
        assert str(choice) == ("critic_packed_attention (packed rows, no CUDA, float32: sdpa per sequence (flash "
                               "kernels need CUDA and bf16/fp16))")


if __name__ == "__main__":
    run_pytest(__file__)
