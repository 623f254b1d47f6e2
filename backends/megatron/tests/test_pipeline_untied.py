"""A critic from a causal LM with tied embeddings runs untied at PP2 (embedding on the first stage,
value head on the last): updates complete (no hang, under a timeout) and the loss goes down."""

import json

import torch

from critic_adapters.backends.megatron.tests.launch import run_torchrun
from critic_adapters.common.testdata import tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead._quiet import quiet_transformers


def test_pp2_updates_complete_with_untied_embeddings(tmp_path):
    model = tiny_causal_lm("qwen2")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    with quiet_transformers():
        model.save_pretrained(str(tmp_path / "tied"))
    g = torch.Generator().manual_seed(0)
    B, T = 6, 12
    mask = torch.ones(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.long)
    response[:, 4:] = 1
    torch.save({"input_ids": torch.randint(3, 990, (B, T), generator=g), "attention_mask": mask,
                "response_mask": response, "old_values": torch.zeros(B, T),
                "returns": torch.randn(B, T, generator=g) * response}, tmp_path / "batch.pt")
    out = tmp_path / "out.pt"
    run_torchrun(2, "critic_adapters.backends.megatron.tests.parity_worker", str(tmp_path / "tied"), str(tmp_path / "batch.pt"),
                 str(out), json.dumps({"pipeline": 2, "steps": 4, "lr": 1e-2}), timeout=300)
    metrics = torch.load(out)["metrics"]
    assert len(metrics) == 4
    losses = [m["value_loss"] for m in metrics]
    assert losses[-1] < losses[0], losses
    assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in metrics)


if __name__ == "__main__":
    run_pytest(__file__)
