"""Packed rows never mix sequences, in every family we keep a tiny config for.

The engine packs several rollouts into one row (position ids restarting at 0) and runs its
per-sequence attention. For each family, its packed values must equal plain, unpacked
`compute_values` on each row alone — including families whose positions are not plain 2-D (the
mrope VLMs) and those with attention quirks (gemma2's logit soft-capping, sliding windows).
"""

import pytest
import torch

from critic_adapters.common.parallel.batching import make_micro_batches
from critic_adapters.common.parallel.packed_attention import ATTENTION_NAME, register
from critic_adapters.common.testdata import FAMILIES, save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic

LENGTHS = [7, 12, 3, 9]  # several sequences in one packed row; the 12 is not first on purpose


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    ids = torch.randint(3, 990, (len(LENGTHS), T), generator=g)
    mask = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    return ids * mask, mask


def _packed_values(model, ids, mask) -> torch.Tensor:
    out = torch.zeros(ids.shape)
    (mb,) = make_micro_batches(ids, mask, packing=True, token_budget=10_000)
    assert mb.input_ids.shape == (1, sum(LENGTHS))
    out[mb.rows] = mb.unpack(compute_values(model, mb.input_ids, None, mb.position_ids), ids.shape[1])
    return out


@pytest.mark.parametrize("attention", ["packed", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_values_equal_each_row_alone(tmp_path, family, attention):
    """Our packed attention (what the engine runs), and transformers' sdpa with its position-id mask."""
    if attention == "sdpa" and family == "gemma2":
        pytest.skip("gemma2 has no sdpa attention in transformers (logit soft-capping)")
    path = save_tiny_causal_lm(family, str(tmp_path / family))
    packed_model, _ = load_critic(path, attn_implementation=register() if attention == "packed" else "sdpa")
    assert packed_model.config.get_text_config()._attn_implementation == (ATTENTION_NAME if attention == "packed" else "sdpa")
    plain_model, _ = load_critic(path, attn_implementation="eager")
    ids, mask = _rows()
    with torch.no_grad():
        packed = _packed_values(packed_model, ids, mask)
        for row, n in enumerate(LENGTHS):
            alone = compute_values(plain_model, ids[row:row + 1, :n], mask[row:row + 1, :n])[0]
            diff = float((packed[row, :n] - alone).abs().max())
            assert diff <= 2e-5, f"{family}: packed row {row} differs from the row alone by {diff:.3g}"


if __name__ == "__main__":
    run_pytest(__file__)
