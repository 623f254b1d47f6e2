"""The model-transform stage (common/engine/transforms.py) on every backend: transforms rewrite the critic
between load and parallelise, optimizers step the trainable parameters only, the fingerprint
records the transforms, and export_hf writes a plain critic (what a transform added is folded
back) whose values are the engine's. On megatron the converted module follows what the transforms
froze; a transform that adds a parameter is refused there by name, before anything is built."""

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.common.storage.checkpoints import critic_fingerprint
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun_group, worker_env
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.tests.conformance.worker import rollout

RUNS = {  # name -> (backend, ranks, transforms)
    "fsdp-1-freeze": ("fsdp", 1, "freeze_backbone"),
    "fsdp-2-freeze-scaled": ("fsdp", 2, "freeze_backbone,scaled_head"),
    "veomni-2-freeze-scaled": ("veomni", 2, "freeze_backbone,scaled_head"),  # VeOmni loads what it adds by name
    "megatron-2-freeze": ("megatron", 2, "freeze_backbone"),
}
HEAD = {"fsdp": {"score.weight", "score.bias"}, "veomni": {"score.weight", "score.bias"},
        "megatron": {"module.output_layer.weight", "module.output_layer.bias"}}  # under megatron's DDP


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_causal_lm("qwen2", str(tmp_path_factory.mktemp("transforms") / "model"))


_DONE: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, model_dir, tmp_path_factory):
    """(transforms, workdir, result) of RUNS[name]; the first one of a process count runs all of that
    count in one transform_worker torchrun."""
    if request.param not in _DONE:
        ranks = RUNS[request.param][1]
        group = [name for name, (_, n, _) in sorted(RUNS.items()) if n == ranks]
        works = run_torchrun_group(ranks, "critic_adapters.tests.transform_worker", group,
                                   lambda name: (RUNS[name][2], RUNS[name][0]), tmp_path_factory, model_dir,
                                   env=worker_env(PYTHONWARNINGS="ignore"))
        for name in group:
            backend, _, transforms = RUNS[name]
            _DONE[name] = transforms.split(","), works[name], dict(torch.load(works[name] / "result.pt"), backend=backend)
    return _DONE[request.param]


def test_only_the_trainable_parameters_are_optimized_and_change(run):
    transforms, _, result = run
    head = HEAD[result["backend"]] | ({"score.scale"} if "scaled_head" in transforms else set())
    assert set(result["trainable"]) == head
    assert result["optimized"] == len(head)
    for name, before in result["before"].items():
        changed = not torch.equal(before, result["after"][name])
        assert changed == (name in head), f"{name} changed={changed}"


def test_the_fingerprint_records_the_transforms(run, model_dir):
    transforms, _, result = run
    plain = critic_fingerprint(load_critic(model_dir)[0])
    assert result["fingerprint"]["transforms"] == transforms
    assert result["fingerprint"] != plain  # a checkpoint of the untransformed critic is refused


def test_the_export_is_the_plain_critic_with_the_engine_values(run):
    transforms, work, result = run
    model, info = AutoModelForTokenClassification.from_pretrained(str(work / "hf_export"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    batch = rollout(0)
    with torch.no_grad():
        got = compute_values(model, batch.input_ids, batch.attention_mask)
    assert float((got - result["values"]).abs()[batch.attention_mask.bool()].max()) <= 1e-5


def test_megatron_refuses_a_transform_that_adds_a_parameter_before_building(model_dir):
    from critic_adapters.common.engine.config import EngineConfig, ModelConfig
    from critic_adapters.common.engine.registry import check_layout
    from critic_adapters.tests.transforms_for_tests import register_test_transforms

    register_test_transforms()
    config = EngineConfig(model=ModelConfig(path=model_dir), transforms=["freeze_embeddings", "scaled_head"])
    with pytest.raises(ValueError, match=r"engine\.transforms names \['scaled_head'\], which add or rename "
                                         r"parameters: the megatron backend"):
        check_layout("megatron", config, 2)
    check_layout("megatron", EngineConfig(model=ModelConfig(path=model_dir), transforms=["freeze_embeddings"]), 2)


if __name__ == "__main__":
    run_pytest(__file__)
