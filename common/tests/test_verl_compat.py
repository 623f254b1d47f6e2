"""load_valuehead_model: verl's signature, working on CPU for every format and family."""

import torch
from transformers import AutoConfig

from common.tests import checkpoint_builders as build
from common.tests.helpers import assert_close_on_mask, padded_batch, run_pytest
from common.valuehead import load_valuehead_model


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


def test_vlm_gets_a_token_classification_style_critic(tmp_path):
    path, _ = build.causal_lm(str(tmp_path), "qwen2_vl")
    model = load_valuehead_model(path, torch.bfloat16, _verl_style_config(path), False)
    ids, mask = padded_batch()
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask).logits.shape == (*ids.shape, 1)
    assert next(model.parameters()).dtype == torch.bfloat16


if __name__ == "__main__":
    run_pytest(__file__)
