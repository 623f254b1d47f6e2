"""load_valuehead_model: verl's signature, working on CPU for every format and family."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoConfig

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import assert_close_on_mask, padded_batch, run_pytest
from critic_adapters.common.valuehead import load_valuehead_model
from critic_adapters.common.valuehead.attention import flash_attention_available


def _verl_style_config(path):
    # What verl's critic builder passes: the HF config with its own (stringly) overrides.
    config = AutoConfig.from_pretrained(path)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.hidden_dropout = "0"
    return config


def test_trl_checkpoint_on_cpu_without_flash_attention(tmp_path):
    path, reference = build.trl_value_head(str(tmp_path))
    model = load_valuehead_model(path, torch.float32, _verl_style_config(path), False)
    assert model.config.hidden_dropout == 0.0 and model.config._attn_implementation == "sdpa"
    ids, mask = padded_batch()
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=mask)
        assert output.logits.shape == (*ids.shape, 1)
        assert_close_on_mask(output.logits.squeeze(-1), reference(ids, mask), mask, atol=2e-5)


# verl's critic builder, in a fresh interpreter: nothing cached by an earlier load may hide a failure.
VERL_CRITIC_BUILD = textwrap.dedent("""
    import sys, torch
    from transformers import AutoConfig
    from critic_adapters.common.valuehead import load_valuehead_model
    path = sys.argv[1]
    config = AutoConfig.from_pretrained(path, attn_implementation="flash_attention_2")
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.hidden_dropout = "0"
    model = load_valuehead_model(path, torch.float32, config, False)
    ids = torch.tensor([[5, 6, 7, 8]])
    print("attention", model.config._attn_implementation)
    print("shape", tuple(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape))
""")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_verls_flash_attention_config_falls_back_in_a_fresh_process(tmp_path, family):
    if flash_attention_available():
        pytest.skip("flash-attention can run here: the config's choice stands")
    path = (build.trl_value_head(str(tmp_path)) if family == "qwen2" else build.causal_lm(str(tmp_path), family))[0]
    result = subprocess.run([sys.executable, "-c", VERL_CRITIC_BUILD, path], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attention sdpa" in result.stdout and "shape (1, 4, 1)" in result.stdout, result.stdout


def test_vlm_gets_a_token_classification_style_critic(tmp_path):
    path, _ = build.causal_lm(str(tmp_path), "qwen2_vl")
    model = load_valuehead_model(path, torch.bfloat16, _verl_style_config(path), False)
    ids, mask = padded_batch()
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask).logits.shape == (*ids.shape, 1)
    assert next(model.parameters()).dtype == torch.bfloat16


if __name__ == "__main__":
    run_pytest(__file__)
