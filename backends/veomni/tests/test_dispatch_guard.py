"""Guarded dispatch: a VeOmni build that is not the critic form is a clear error, never [B, T, vocab]
values; string dropouts become floats; unregistered families get VeOmni's transformers path or a
clear error; nothing on meta; Ulysses refused on CPU."""

import json
import os

import pytest
import torch

from critic_adapters.backends.veomni import value_model
from critic_adapters.common.engine.registry import check_engine_config
from critic_adapters.backends.veomni.tests.launch import run_torchrun, worker_env
from critic_adapters.common.engine.config import EngineConfig, ParallelConfig
from critic_adapters.common.tests import checkpoint_builders
from critic_adapters.common.tests.helpers import padded_batch, run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic

VALUES = "critic_adapters.backends.veomni.tests.values_worker"
DISPATCH = "critic_adapters.backends.veomni.tests.dispatch_worker"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("veomni_dispatch")


def _batch(root) -> tuple[str, torch.Tensor, torch.Tensor]:
    ids, mask = padded_batch(seed=5, batch=3, length=9)
    path = str(root / "batch.pt")
    torch.save({"input_ids": ids, "attention_mask": mask}, path)
    return path, ids, mask


def test_causal_lm_dispatch_is_a_clear_error(root):
    model_dir, _ = checkpoint_builders.causal_lm(str(root), "qwen2")
    out = str(root / "dispatch.pt")
    run_torchrun(1, DISPATCH, model_dir, out)
    result = torch.load(out)
    assert result["veomni_class"] == "Qwen2ForCausalLM"  # the override does make VeOmni pick a causal LM
    assert "values_shape" not in result, f"the engine built and returned values of shape {result.get('values_shape')}"
    error = result["error"]
    assert "VeOmni 0.1.12 built" in error and "Qwen2ForCausalLM" in error and "Qwen2ForTokenClassification" in error
    assert "install veomni==0.1.12" in error


def test_string_dropouts_become_floats(root):
    """verl's critic config carries hidden_dropout="0" (a string) and classifier_dropout null."""
    model_dir, _ = checkpoint_builders.causal_lm(str(root / "verl"), "qwen2")
    config_file = os.path.join(model_dir, "config.json")
    config = json.load(open(config_file))
    config.update(hidden_dropout="0", classifier_dropout=None)
    json.dump(config, open(config_file, "w"))
    batch, ids, mask = _batch(root)
    out = str(root / "dropout.pt")
    run_torchrun(1, VALUES, batch, out, model_dir)
    result = torch.load(out)[model_dir]
    assert "error" not in result, result
    assert result["dropouts"] == {"hidden_dropout": 0.0, "classifier_dropout": 0.0}
    assert all(type(v) is float for v in result["dropouts"].values())
    critic, _ = load_critic(model_dir)
    with torch.no_grad():
        expected = compute_values(critic, ids, mask)
    assert float((result["values"] - expected).abs()[mask.bool()].max()) <= 1e-5


def test_unregistered_family(root):
    """mistral is not in VeOmni 0.1.12's registry: a clear error naming the way out, and with
    MODELING_BACKEND=hf (VeOmni's transformers path) the critic form and the same values."""
    model_dir, _ = checkpoint_builders.token_classification(str(root), family="mistral")
    batch, ids, mask = _batch(root)
    out = str(root / "mistral.pt")
    run_torchrun(1, VALUES, batch, out, model_dir)
    error = torch.load(out)[model_dir]["error"]
    assert "VeOmni 0.1.12 has no modeling for model_type 'mistral'" in error and "MODELING_BACKEND=hf" in error
    # the backends that build it (megatron's is named where this build has it: tests/test_moe.py)
    assert "or use backend=fsdp" in error and "for this family" in error

    run_torchrun(1, VALUES, batch, out, model_dir, env=worker_env(MODELING_BACKEND="hf"))
    result = torch.load(out)[model_dir]
    assert "error" not in result, result
    assert result["critic_class"] == "MistralForTokenClassification"
    critic, _ = load_critic(model_dir)
    with torch.no_grad():
        expected = compute_values(critic, ids, mask)
    assert float((result["values"] - expected).abs()[mask.bool()].max()) <= 1e-5


def test_the_declared_families_are_the_installed_veomnis_registry():
    """The launcher refuses a family VeOmni has no modeling for from VEOMNI_FAMILIES, without importing
    VeOmni (issue 40, 4); the list must be the installed VeOmni's MODELING_REGISTRY."""
    from critic_adapters.backends.veomni.quiet import veomni_output
    from critic_adapters.backends.veomni.value_model import VEOMNI_FAMILIES

    with veomni_output():
        from veomni.models.loader import MODELING_REGISTRY

    assert sorted(VEOMNI_FAMILIES) == sorted(MODELING_REGISTRY.valid_keys())


def test_veomnis_ops_are_eager_unless_the_policy_chooses_liger(monkeypatch):
    """Issue 41, item 5: on a GPU the engine kept VeOmni's defaults (liger / triton / fla kernels),
    which raise while building when liger-kernel is not installed: eager unless the kernel policy
    (common.parallel.kernels.veomni_ops) chooses liger, on every device."""
    from critic_adapters.backends.veomni import compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    eager = compat.ops_implementation("sdpa")
    assert eager.attn_implementation == "sdpa"
    assert {getattr(eager, name) for name in compat._EAGER_KERNELS} == {"eager"}
    liger = compat.ops_implementation("sdpa", "liger")
    assert {getattr(liger, name) for name in compat._LIGER_KERNELS} == {"liger_kernel"}
    assert {getattr(liger, name) for name in set(compat._EAGER_KERNELS) - set(compat._LIGER_KERNELS)} == {"eager"}


def test_meta_parameters_are_refused():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="on the meta device"):
        value_model.check_materialized(model)


def test_parallel_degrees_it_lacks_are_refused_by_key():
    with pytest.raises(ValueError, match=r"does not implement engine.parallel.context=2 \(offered by backend=megatron\)"):
        check_engine_config("veomni", EngineConfig(parallel=ParallelConfig(context=2)))
    check_engine_config("veomni", EngineConfig(parallel=ParallelConfig(ulysses=2)))  # Ulysses: implemented
    with pytest.raises(ValueError, match=r"engine.parallel.tensor=2 \(offered by backend=megatron\)"):
        check_engine_config("veomni", EngineConfig(parallel=ParallelConfig(tensor=2)))


if __name__ == "__main__":
    run_pytest(__file__)
