"""VeOmni engine checkpoints (DCP) reshard between world sizes with optimizer and schedule, and the
HF export loads in plain transformers with the engine's values."""

import json
import math

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.backends.veomni.tests.launch import run_torchrun
from critic_adapters.backends.veomni.tests.worker_common import make_batch
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest

WORKER = "critic_adapters.backends.veomni.tests.checkpoint_worker"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank run: 3 updates, a checkpoint, an HF export, a 4th update."""
    root = tmp_path_factory.mktemp("veomni_ckpt")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    data = make_batch(str(root / "batch.pt"))
    run_torchrun(2, WORKER, "train-save", model_dir, str(root / "batch.pt"), str(root))
    return root, model_dir, data, torch.load(root / "train-save-world2.pt")


def test_cpu_offload_is_honoured_on_cpu_at_two_ranks_and_changes_no_number(saved):
    """issue 49: VeOmni ignored engine.cpu_offload on CPU; it applies FSDP2's CPUOffloadPolicy there as
    fsdp does (the plumbing a GPU run takes), and the run takes the same steps; one rank is refused by name."""
    from critic_adapters.backends.veomni.value_model import check_layout
    from critic_adapters.common.engine.config import EngineConfig
    from critic_adapters.common.testdata import tiny_config
    from critic_adapters.common.valuehead import critic_config

    _, _, _, result = saved
    assert result["offload_policies"] == ["CPUOffloadPolicy"], result["offload_policies"]
    assert result["offload_losses"] == pytest.approx(result["losses"], rel=1e-6)
    assert (result["offload_values"] - result["saved"]).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="engine.cpu_offload=true on veomni with one data-parallel rank"):
        check_layout(critic_config(tiny_config("qwen2")), EngineConfig(cpu_offload=True), 1)
    check_layout(critic_config(tiny_config("qwen2")), EngineConfig(cpu_offload=True), 2)


def test_two_rank_checkpoint_loads_on_one_rank(saved):
    root, model_dir, data, before = saved
    assert before["losses"][-1] < before["losses"][0]  # two-rank training lowers the loss
    run_torchrun(1, WORKER, "load-continue", model_dir, str(root / "batch.pt"), str(root))
    loaded = torch.load(root / "load-continue-world1.pt")
    mask = data["attention_mask"].bool()
    assert loaded["extra"] == {"position": 3}
    assert float((loaded["loaded"] - before["saved"]).abs()[mask].max()) <= 1e-6
    # The optimizer and schedule came along: the next step lands where the 2-rank run's did.
    assert float((loaded["continued"] - before["continued"]).abs()[mask].max()) <= 1e-5
    assert float((loaded["continued"] - loaded["loaded"]).abs()[mask].max()) > 1e-4  # the step did something
    # VeOmni's cosine schedule, 2 warmup steps of 10: the 4th step (index 3) is 1/8 into the decay.
    assert loaded["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 8)))


def test_hf_export_loads_in_plain_transformers_with_the_engines_values(saved):
    root, _, data, before = saved
    model, info = AutoModelForTokenClassification.from_pretrained(str(root / "hf_export"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.architectures == ["Qwen2ForTokenClassification"] and model.config.num_labels == 1
    written = json.load(open(root / "hf_export" / "config.json"))
    assert not [key for key in written if key.startswith("encoder_data_balance")], "VeOmni's switches in config.json"
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits.squeeze(-1)
    mask = data["attention_mask"].bool()
    assert float((logits - before["saved"]).abs()[mask].max()) <= 1e-5


if __name__ == "__main__":
    run_pytest(__file__)
