"""The megatron engine's values equal common.valuehead.compute_values on the same checkpoint, for
qwen2 and llama from a trl value-head and a TokenClassification checkpoint, at TP1 (<= 1e-5) and
TP2, PP2, TP2+SP, DP2 (<= 2e-5), packed and padded."""

import os

import pytest
import torch

from critic_adapters.backends.megatron.tests.launch import run_torchrun
from critic_adapters.common.testdata import tiny_causal_lm
from critic_adapters.common.tests import checkpoint_builders
from critic_adapters.common.tests.helpers import padded_batch, run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead._quiet import quiet_transformers
from critic_adapters.common.valuehead.trl_compat import trl_value_head_class

LAYOUTS = {  # name: (processes, spec, tolerance)
    "tp1": (1, {"tensor": 1}, 1e-5),
    "tp1-padded": (1, {"tensor": 1, "packing": False}, 1e-5),
    "tp2": (2, {"tensor": 2}, 2e-5),
    "pp2": (2, {"pipeline": 2}, 2e-5),
    "tp2-sp": (2, {"tensor": 2, "sequence_parallel": True}, 2e-5),
    "dp2": (2, {"tensor": 1}, 2e-5),
}


def trl_checkpoint(root: str, family: str) -> str:
    """trl AutoModelForCausalLMWithValueHead written by trl itself, with a non-trivial head."""
    wrapper = trl_value_head_class().from_pretrained(tiny_causal_lm(family, seed=3), summary_dropout_prob=0.0)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        wrapper.v_head.summary.weight.copy_(torch.randn(1, 64, generator=g) * 0.5)
        wrapper.v_head.summary.bias.fill_(0.7)
    path = os.path.join(root, f"trl-{family}")
    with quiet_transformers():
        wrapper.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpts"))
    paths = {}
    for family in ("qwen2", "llama"):
        if trl_value_head_class() is not None:  # trl >= 1.13 has no value-head class to write one
            paths[f"trl-{family}"] = trl_checkpoint(root, family)
        paths[f"tokcls-{family}"] = checkpoint_builders.token_classification(root, family=family)[0]
    return paths


@pytest.fixture(scope="module")
def references(checkpoints):
    ids, mask = padded_batch(seed=1, batch=4, length=11)
    refs = {}
    for name, path in checkpoints.items():
        model, report = load_critic(path)
        assert report.head == "loaded", report
        with torch.no_grad():
            refs[name] = compute_values(model, ids, mask)
    return refs, mask.bool()


@pytest.fixture(scope="module")
def layout_values(checkpoints, tmp_path_factory) -> dict:
    """{layout: {checkpoint: values}}: every layout of one process count in one torchrun (engines one
    after another), the negative control ("naive_qkv", one process) with the one-process layouts."""
    import json

    root = tmp_path_factory.mktemp("values")
    out = {}
    for nproc in sorted({n for n, _, _ in LAYOUTS.values()}):
        layouts = {name: spec for name, (n, spec, _) in LAYOUTS.items() if n == nproc}
        if nproc == 1:
            layouts["naive_qkv"] = {"naive_qkv": True}
        path = root / f"values{nproc}.pt"
        run_torchrun(nproc, "critic_adapters.backends.megatron.tests.values_worker", str(path), json.dumps(layouts),
                     *checkpoints.values(), timeout=600)
        out.update(torch.load(path))
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_values_match_the_hf_critic(layout, checkpoints, references, layout_values):
    _, _, tolerance = LAYOUTS[layout]
    results = layout_values[layout]
    refs, mask = references
    for name, path in checkpoints.items():
        diff = float((results[path] - refs[name]).abs()[mask].max())
        assert diff <= tolerance, f"{layout} {name}: values differ by {diff}"
        # The values are not trivially equal (e.g. all zero): the heads carry weight and bias.
        assert float(refs[name][mask].std()) > 1e-2


def test_negative_control_naive_qkv_fusion(checkpoints, references, layout_values):
    """The comparison can fail: fusing q, k, v without grouping per KV head gives a large difference."""
    path = checkpoints["tokcls-qwen2"]
    refs, mask = references
    diff = float((layout_values["naive_qkv"][path] - refs["tokcls-qwen2"]).abs()[mask].max())
    assert diff > 1e-2, f"a wrong QKV layout went unnoticed (diff {diff})"


if __name__ == "__main__":
    run_pytest(__file__)
