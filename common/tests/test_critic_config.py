"""critic_config: the HF config override to a per-token scalar critic, as a pure function."""

import pytest
import torch
from transformers import AutoModelForTokenClassification, PretrainedConfig

from critic_adapters.common.testdata import FAMILIES, VLM_FAMILIES, tiny_config
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead import critic_config
from critic_adapters.common.valuehead.config import (GENERIC_ARCHITECTURE, build_critic, config_in_dtype, critic_class,
                                                      critic_head)


@pytest.mark.parametrize("family", FAMILIES)
def test_override_fields_are_floats_and_input_is_untouched(family):
    original = tiny_config(family)
    before = original.to_dict()
    config = critic_config(original)
    assert original.to_dict() == before, "critic_config modified its input"
    assert config.num_labels == 1
    for name in ("classifier_dropout", "hidden_dropout", "summary_dropout_prob"):
        value = getattr(config, name)
        assert type(value) is float and value == 0.0, f"{name}={value!r}"
    assert config.tie_word_embeddings is False
    assert config.get_text_config().tie_word_embeddings is False
    assert config.hidden_size == config.get_text_config().hidden_size == 64
    expected = GENERIC_ARCHITECTURE if family in ("gemma3_text", *VLM_FAMILIES) else critic_class(config).__name__
    assert config.architectures == [expected]
    assert critic_config(config).to_dict() == config.to_dict(), "not idempotent"


@pytest.mark.parametrize("family", FAMILIES)
def test_critic_builds_with_a_scalar_head_and_no_dropout(family):
    config = critic_config(tiny_config(family))
    torch.manual_seed(0)
    model = critic_class(config)(config)
    assert critic_head(model).out_features == 1
    assert model.dropout.p == 0.0  # the dropout in front of the head
    ids = torch.randint(3, 900, (2, 5))
    assert model(input_ids=ids).logits.shape == (2, 5, 1)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_a_critic_declared_bf16_builds_in_the_dtype_asked_for(family):
    """issue 53: the checkpoint's declared dtype (bf16, as verl saves) never reaches the build: every
    config of the copy says the dtype asked for (a nested AutoModel.from_config reads it: transformers
    < 5.12; tests/test_saved_critics.py runs the engines under one), and the input is untouched."""
    config = critic_config(tiny_config(family))
    config.dtype = torch.bfloat16
    for sub in config.sub_configs:
        getattr(config, sub).dtype = torch.bfloat16
    copy = config_in_dtype(config, torch.float32)
    configs = [copy] + [getattr(copy, sub) for sub in copy.sub_configs]
    assert [c.dtype for c in configs] == [torch.float32] * len(configs)
    assert config.dtype == torch.bfloat16
    with torch.device("meta"):
        model = build_critic(config, dtype=torch.float32, attn_implementation="sdpa")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_typed_dropout_family_accepts_the_override():
    # gpt_neox types hidden_dropout as float|int: verl's string "0" is rejected there; ours builds.
    config = critic_config(tiny_config("gpt_neox"))
    model = AutoModelForTokenClassification.from_config(config)
    assert model.dropout.p == 0.0


def test_no_critic_form_is_a_clear_value_error():
    class MadeUpConfig(PretrainedConfig):
        model_type = "made_up_family"

    with pytest.raises(ValueError, match="made_up_family.*no critic form"):
        critic_config(MadeUpConfig(hidden_size=8))


def test_configs_are_found_through_runfiles_under_bazel():
    import os

    from critic_adapters.common.testdata import data_path

    path = data_path("configs/qwen2.json")
    assert os.path.isfile(path)
    if os.environ.get("TEST_SRCDIR"):  # under `bazel test`: the declared data, located by bazel-runfiles
        from runfiles import runfiles

        assert path == runfiles.Create().Rlocation("critic_adapters/common/testdata/configs/qwen2.json")


def test_configs_are_found_under_a_bazel_run_without_the_runfiles_package(tmp_path):
    # Another stack's Bazel test sets RUNFILES_DIR but need not have the bazel-runfiles package.
    import os
    import subprocess
    import sys

    probe = ("import sys; sys.modules['runfiles'] = None\n"  # makes `import runfiles` fail
             "from critic_adapters.common.testdata import data_path, tiny_config\n"
             "print(data_path('configs/qwen2.json')); print(tiny_config('qwen2').model_type)")
    env = dict(os.environ, RUNFILES_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("RUNFILES_MANIFEST_FILE", None)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    path, family = result.stdout.split()
    assert os.path.isfile(path) and family == "qwen2"


if __name__ == "__main__":
    run_pytest(__file__)
