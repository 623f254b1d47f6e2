"""bf16 mixed precision with an fp32 head, activation checkpointing, and CPU offload on CPU."""

import torch

from critic_adapters.backends.fsdp.tests.launch import run_torchrun
from critic_adapters.backends.fsdp.tests.test_engine_parity import make_batch
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic


def test_bf16_with_activation_checkpointing_on_two_ranks(tmp_path):
    model_dir = save_tiny_causal_lm("qwen2", str(tmp_path / "model"))
    data = make_batch(str(tmp_path / "batch.pt"))
    run_torchrun(2, "critic_adapters.backends.fsdp.tests.options_worker", model_dir, str(tmp_path / "batch.pt"), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    # The head runs in fp32 on an fp32 input (cast up from the bf16 body), so values are fp32.
    assert out["head_dtypes"] == ["torch.float32", "torch.float32"] and out["values_dtype"] == "torch.float32"
    reference = compute_values(load_critic(model_dir)[0], data["input_ids"], data["attention_mask"]).detach()
    mask = data["attention_mask"].bool()
    diff = float((out["values"] - reference).abs()[mask].max())
    assert 0 < diff < 0.05, f"bf16 values differ from fp32 by {diff}"  # close, and really bf16
    assert out["checkpointing"] is True
    assert out["losses"][-1] < 0.7 * out["losses"][0], out["losses"]
    assert not any("cpu_offload" in w for w in out["warnings"]), out["warnings"]  # honoured on CPU too


if __name__ == "__main__":
    run_pytest(__file__)
