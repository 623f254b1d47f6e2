"""Bad input gets a clear error naming the problem and the fix, and nothing is written."""

import json
import os
import shutil

import pytest

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.valuehead import CriticLoadError, load_critic
from critic_adapters.common.valuehead.cli import main as cli


def _edit_config(path, **updates):
    config_file = os.path.join(path, "config.json")
    config = json.load(open(config_file))
    config.update(updates)
    json.dump(config, open(config_file, "w"))


def test_unknown_model_type(tmp_path):
    path, _ = build.causal_lm(str(tmp_path))
    _edit_config(path, model_type="not_a_real_family")
    with pytest.raises(CriticLoadError, match="unknown model_type 'not_a_real_family'"):
        load_critic(path)


def test_trust_remote_code_required_but_not_given(tmp_path):
    path, _ = build.causal_lm(str(tmp_path))
    _edit_config(path, model_type="my_custom_lm", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    with pytest.raises(CriticLoadError, match="trust_remote_code=True"):
        load_critic(path)


def test_head_under_unrecognised_name_is_an_error_not_a_silent_reinit(tmp_path):
    path, reference = build.unknown_head_name(str(tmp_path))
    with pytest.raises(CriticLoadError, match=r"critic_head\.bias.*critic_head\.weight.*head_prefix.*fresh_head=True"):
        load_critic(path)
    # Asked for explicitly, both ways work:
    model, report = load_critic(path, head_prefix="critic_head")
    assert report.head == "loaded" and report.format == "custom-head-prefix" and report.bias == "loaded"
    model, report = load_critic(path, fresh_head=True)
    assert report.head == "initialized"
    assert set(report.unexpected_keys) == {"critic_head.weight", "critic_head.bias"}


def test_head_prefix_that_is_not_there(tmp_path):
    path, _ = build.unknown_head_name(str(tmp_path))
    with pytest.raises(CriticLoadError, match="no tensor 'value_head.weight'.*critic_head.weight"):
        load_critic(path, head_prefix="value_head")


@pytest.mark.parametrize("shape", [(2, 64), (8, 8), (1, 32)])
def test_head_of_the_wrong_shape(tmp_path, shape):
    import torch
    from safetensors.torch import load_file, save_file

    path, _ = build.megatron_export(str(tmp_path))
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    state["lm_head.weight"] = torch.zeros(shape)
    if shape[0] != 1:
        # A [8, 8] / [2, 64] head is not detected as Megatron's [1, H]; call it by name.
        state["value_head.weight"] = state.pop("lm_head.weight")
    save_file(state, weights)
    kwargs = {"head_prefix": "value_head"} if shape[0] != 1 else {}
    with pytest.raises(CriticLoadError, match=r"has shape \[.*\], but a value head for this model must be \[1, 64\]") as err:
        load_critic(path, **kwargs)
    if shape == (8, 8):
        assert "reshape" in str(err.value)


def test_empty_safetensors(tmp_path):
    path, _ = build.causal_lm(str(tmp_path))
    open(os.path.join(path, "model.safetensors"), "wb").close()
    with pytest.raises(CriticLoadError, match="empty or truncated"):
        load_critic(path)


def test_truncated_safetensors(tmp_path):
    path, _ = build.causal_lm(str(tmp_path))
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CriticLoadError, match="truncated"):
        load_critic(path)


def test_missing_backbone_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = build.causal_lm(str(tmp_path))
    weights = os.path.join(path, "model.safetensors")
    state = {k: v for k, v in load_file(weights).items() if ".layers.1." not in k}
    save_file(state, weights)
    with pytest.raises(CriticLoadError, match="lacks .* backbone tensors"):
        load_critic(path)


def test_no_weights_and_no_config(tmp_path):
    path, _ = build.causal_lm(str(tmp_path))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CriticLoadError, match="holds no weights"):
        load_critic(path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CriticLoadError, match="no config.json"):
        load_critic(path)


def test_convert_onto_existing_nonempty_directory_writes_nothing(tmp_path, capsys):
    src, _ = build.trl_value_head(str(tmp_path))
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    assert cli(["convert", src, str(dst)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert os.listdir(dst) == ["keep.txt"]
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []


def test_convert_of_a_bad_source_leaves_no_output(tmp_path, capsys):
    src, _ = build.unknown_head_name(str(tmp_path))
    dst = tmp_path / "dst"
    assert cli(["convert", src, str(dst)]) == 2
    assert "head_prefix" in capsys.readouterr().err
    assert not dst.exists()
    shutil.rmtree(src)


if __name__ == "__main__":
    run_pytest(__file__)
