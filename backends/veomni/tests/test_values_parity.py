"""The VeOmni engine's values equal common.valuehead.compute_values on the same checkpoint (<= 1e-5),
for qwen2 and llama, from a trl-format and from a TokenCls checkpoint, at 1 and 2 ranks, packed
and padded."""

import os

import pytest
import torch

from critic_adapters.backends.veomni.tests.launch import run_torchrun
from critic_adapters.common.testdata import tiny_causal_lm
from critic_adapters.common.tests import checkpoint_builders
from critic_adapters.common.tests.helpers import padded_batch, run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead._quiet import quiet_transformers
from critic_adapters.common.valuehead.trl_compat import trl_value_head_class

WORKER = "critic_adapters.backends.veomni.tests.values_worker"


def trl_checkpoint(root: str, family: str) -> str:
    """trl AutoModelForCausalLMWithValueHead over a tiny `family` model, saved by trl itself."""
    wrapper = trl_value_head_class().from_pretrained(tiny_causal_lm(family), summary_dropout_prob=0.0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        wrapper.v_head.summary.weight.copy_(torch.randn(wrapper.v_head.summary.weight.shape, generator=g) * 0.5)
        wrapper.v_head.summary.bias.fill_(0.2)
    path = os.path.join(root, f"trl-{family}")
    with quiet_transformers():
        wrapper.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("veomni_values"))
    paths = {}
    for family in ("qwen2", "llama"):
        if trl_value_head_class() is not None:  # trl >= 1.13 has no value-head class to write one
            paths[f"trl-{family}"] = trl_checkpoint(root, family)
        paths[f"tokcls-{family}"], _ = checkpoint_builders.token_classification(root, family=family)
    ids, mask = padded_batch(seed=3, batch=5, length=13)
    batch = os.path.join(root, "batch.pt")
    torch.save({"input_ids": ids, "attention_mask": mask}, batch)
    expected = {}
    for name, path in paths.items():
        critic, _ = load_critic(path)
        with torch.no_grad():
            expected[name] = compute_values(critic, ids, mask)
    return root, paths, batch, mask, expected


@pytest.mark.parametrize("nproc", [1, 2])
def test_values_equal_compute_values(checkpoints, nproc):
    root, paths, batch, mask, expected = checkpoints
    out = os.path.join(root, f"values-{nproc}.pt")
    specs = [*paths.values(), paths.get("trl-llama", paths["tokcls-llama"]) + "@packing=false"]
    run_torchrun(nproc, WORKER, batch, out, *specs)
    results = torch.load(out)
    for name, path in paths.items():
        for spec in (path, path + "@packing=false"):
            if spec not in results:
                continue
            got = results[spec]
            assert "error" not in got, (spec, got)
            assert not got["changed_process_state"], f"building the engine changed {got['changed_process_state']}"
            assert got["critic_class"].removeprefix("FSDP").endswith("ForTokenClassification"), got["critic_class"]
            diff = float((got["values"] - expected[name]).abs()[mask.bool()].max())
            assert diff <= 1e-5, f"{spec} at {nproc} ranks: values differ by {diff:.3g}"
    if "trl-qwen2" in paths:
        assert "format       trl-value-head" in results[paths["trl-qwen2"]]["report"]
    assert "format       hf-token-classification" in results[paths["tokcls-llama"]]["report"]


if __name__ == "__main__":
    run_pytest(__file__)
