"""Guarded dispatch: a VeOmni build that is not the critic form is a clear error, never [B, T, vocab]
values; string dropouts become floats; unregistered families get VeOmni's transformers path or a
clear error; nothing on meta; Ulysses refused on CPU; the probe on the critic's one-layer twin
decides as the probe on the critic itself did."""

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
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead.config import critic_class, critic_config, head_name

VALUES = "critic_adapters.backends.veomni.tests.values_worker"
DISPATCH = "critic_adapters.backends.veomni.tests.dispatch_worker"
PROBE = "critic_adapters.backends.veomni.tests.probe_worker"
# Families VeOmni models with a TokenCls class in transformers and a tiny config (common/testdata).
TWIN_FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe", "deepseek_v3")


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


@pytest.mark.parametrize("family", [*TWIN_FAMILIES, "gemma3_text", "qwen2_vl"])  # and two generic critics
def test_the_probes_twin_is_the_critics_class_with_one_layer(family):
    critic = critic_config(tiny_config(family))
    layers = critic.get_text_config().num_hidden_layers
    twin = value_model.probe_config(critic)
    assert critic_class(twin) is critic_class(critic) and head_name(twin) == head_name(critic)
    assert twin.num_labels == critic.num_labels and twin.architectures == critic.architectures
    text, twin_text = critic.get_text_config(), twin.get_text_config()
    assert twin_text.num_hidden_layers == 1 and text.num_hidden_layers == layers  # the critic's config: a copy
    assert twin_text.vocab_size <= value_model.PROBE_WIDTH
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "model_type"):
        assert getattr(twin_text, name, None) == getattr(text, name, None), name


@pytest.mark.parametrize("layers", [1, 4, 24])
def test_the_probes_twin_is_a_fifth_of_the_critic_at_most(layers):
    """tests/test_rank_memory.py's 4-layer critic's shape (hidden 1024, MLPs 3520, 2048 tokens), at 1 to 24
    layers: the twin's parameters (built on meta) are at most 0.2x the critic's."""
    from transformers import Qwen2Config

    def parameters(config) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in critic_class(config)(config).parameters())

    critic = critic_config(Qwen2Config(hidden_size=1024, intermediate_size=3520, num_hidden_layers=layers,
                                       num_attention_heads=8, num_key_value_heads=2, vocab_size=2048))
    assert parameters(value_model.probe_config(critic)) <= 0.2 * parameters(critic)


def test_the_probe_on_the_twin_decides_as_on_the_critic(root):
    """Issue 44, item 4: the engine probes a one-layer twin (value_model.probe_config), not the sharded
    critic (whose forward gathered whole layers: 0.72x of a 4-layer critic per rank). At 2 ranks (FSDP;
    Ulysses 2), per family and head, the twin's output on the probe, and check_probe_output's decision,
    are the critic's; a transform that reshapes the head's output is refused on both."""
    cases = {family: (checkpoint_builders.moe_token_classification(str(root), family)[0]
                      if family in ("qwen3_moe", "deepseek_v3") else
                      checkpoint_builders.token_classification(str(root), family=family)[0])
             for family in TWIN_FAMILIES}
    for variant in ("ulysses", "hl_gauss", "lora", "bad_head"):
        cases[f"qwen2-{variant}"] = cases["qwen2"]
    out = str(root / "probe.pt")
    run_torchrun(2, PROBE, out, *(f"{case}={path}" for case, path in cases.items()))
    results = torch.load(out)
    assert sorted(results) == sorted(cases)
    for case, result in results.items():
        (twin_meta, twin_shape, twin_error), (meta, shape, error) = result["twin"], result["critic"]
        assert (twin_meta, twin_shape) == (meta, shape), (case, result)
        assert (twin_error is None) == (error is None), (case, result)
        assert result["twin_parameters"] < result["critic_parameters"], (case, result)
        if case.endswith("bad_head"):
            refused = "on a [1, 4] probe it returns [1, 4, 1, 1], not [1, 4, 1]"
            assert refused in twin_error and refused in error, (twin_error, error)
        else:
            assert shape == (1, 4, 1) and not meta and error is None, (case, result)


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
