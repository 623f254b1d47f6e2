"""Drop-in replacement for verl's `verl.utils.model.load_valuehead_model`, for stacks vendoring us.

Same signature; runs on CPU (no hard-coded flash-attention), reads every format load_critic
reads, and returns a `*ForTokenClassification`-style critic (output `.logits` [B, T, 1]) even for
families verl would wrap with trl.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from .load import load_critic


def load_valuehead_model(
    local_path: str,
    torch_dtype: torch.dtype,
    model_config: PretrainedConfig,
    trust_remote_code: bool,
) -> torch.nn.Module:
    model, _ = load_critic(local_path, torch_dtype=torch_dtype, config=model_config, trust_remote_code=trust_remote_code)
    return model
