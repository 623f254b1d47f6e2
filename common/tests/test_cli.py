"""python -m critic_adapters.common.valuehead: inspect, convert, values, demo."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import assert_close_on_mask, padded_batch, run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead.cli import main as cli


def test_inspect_reports_format_head_and_what_is_initialised(tmp_path, capsys):
    path, _ = build.trl_sidecar(str(tmp_path))
    assert cli(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "trl-value-head" and info["storage"] == "sidecar"
    assert info["head"] == {"v_head.summary.weight": [1, 64], "v_head.summary.bias": [1]}
    assert info["would_initialise"] == [] and info["ignored"] == ["lm_head.weight"]
    assert info["family"] == "qwen2" and info["critic_class"] == "Qwen2ForTokenClassification"

    path, _ = build.openrlhf(str(tmp_path))
    assert cli(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "openrlhf" and info["head"] == {"value_head.weight": [1, 64]}
    assert info["would_initialise"] == ["score.bias (zero: this format has no bias)"]

    path, _ = build.causal_lm(str(tmp_path))
    assert cli(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "causal-lm" in out and "score.weight (fresh head)" in out
    assert "experts" not in out  # a dense model


def test_inspect_and_the_load_report_describe_the_experts(tmp_path, capsys):
    """Mixture-of-experts checkpoints written by transformers: routed experts, top-k, whether the
    top-k weights are renormalised, the shared expert, the layers that route."""
    from critic_adapters.common.valuehead import load_critic

    path, _ = build.moe_token_classification(str(tmp_path), "qwen2_moe")
    assert cli(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["experts"] == ("4 routed, top-2, not renormalised; a gated shared expert of width 64; "
                               "MoE in 2 of 2 layers"), info["experts"]
    path, _ = build.moe_token_classification(str(tmp_path), "mixtral")
    assert "  experts      4 routed, top-2, renormalised; MoE in 2 of 2 layers" in str(load_critic(path)[1])


def test_convert_writes_a_plain_token_classification_model(tmp_path, capsys):
    src, reference = build.trl_value_head(str(tmp_path), storage="sharded")
    dst = str(tmp_path / "converted")
    assert cli(["convert", src, dst]) == 0
    assert "wrote" in capsys.readouterr().out
    model = AutoModelForTokenClassification.from_pretrained(dst)
    ids, mask = padded_batch()
    with torch.no_grad():
        assert_close_on_mask(model(input_ids=ids, attention_mask=mask).logits.squeeze(-1), reference(ids, mask),
                             mask, atol=2e-5)


CONVERTIBLE = {
    "trl-inline": lambda root: build.trl_value_head(root),
    "trl-sharded": lambda root: build.trl_value_head(root, storage="sharded"),
    "trl-sidecar": lambda root: build.trl_sidecar(root),
    "trl-verl-state-dict": build.trl_patched_state_dict,
    "token-classification": build.token_classification,
    "token-classification-gpt-neox": lambda root: build.token_classification(root, family="gpt_neox"),
    "sequence-classification": build.sequence_classification,
    "openrlhf-value_head": build.openrlhf,
    "openrlhf-score": lambda root: build.openrlhf(root, prefix="score"),
    "megatron-export": build.megatron_export,
    "megatron-export-bias": lambda root: build.megatron_export(root, with_bias=True),
    "verl-legacy": build.verl_legacy,
    "causal-lm-fresh-head": build.causal_lm,
}


@pytest.mark.parametrize("fmt", sorted(CONVERTIBLE))
def test_every_format_converts_to_a_directory_both_loaders_read(tmp_path, fmt, capsys):
    # The converted directory's config must describe what was written (an OpenRLHF config once kept
    # value_head_prefix="value_head" over score.* tensors, which inspect and load_critic refused).
    src, _ = CONVERTIBLE[fmt](str(tmp_path / "src"))
    dst = str(tmp_path / "converted")
    assert cli(["convert", src, dst]) == 0
    assert cli(["inspect", dst, "--json"]) == 0, capsys.readouterr().err
    source, _ = load_critic(src)
    converted, report = load_critic(dst)
    assert report.head == "loaded" and report.missing_keys == [] and report.unexpected_keys == []
    with open(os.path.join(dst, "config.json")) as f:
        written = json.load(f)
    if "value_head_prefix" in written:  # OpenRLHF reads the head from <prefix>.weight
        assert f"{written['value_head_prefix']}.weight" in converted.state_dict()
    plain, info = AutoModelForTokenClassification.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = compute_values(source, ids, mask)
        assert_close_on_mask(compute_values(converted, ids, mask), expected, mask, atol=1e-6)
        assert_close_on_mask(plain(input_ids=ids, attention_mask=mask).logits.squeeze(-1), expected, mask, atol=1e-5)


@pytest.mark.parametrize("size, sharded", [("100000", True), ("2G", False), ("2GB", False), ("500MB", False),
                                           ("300KiB", True), ("1.5mb", False)])
def test_convert_takes_bytes_and_transformers_style_sizes(tmp_path, size, sharded, capsys):
    """--max-shard-size: bytes as digits, or a number with a unit (the tiny critic is ~0.55 MB)."""
    src, _ = build.trl_value_head(str(tmp_path / "src"))
    dst = str(tmp_path / "converted")
    assert cli(["convert", src, dst, "--max-shard-size", size]) == 0, capsys.readouterr().err
    assert os.path.exists(os.path.join(dst, "model.safetensors.index.json")) == sharded
    assert os.path.exists(os.path.join(dst, "model.safetensors")) == (not sharded)


@pytest.mark.parametrize("size", ["five", "2X", "0", "0GB", "GB", ""])
def test_convert_refuses_a_bad_size_naming_the_forms_it_takes(tmp_path, size, capsys):
    src, _ = build.trl_value_head(str(tmp_path / "src"))
    dst = tmp_path / "converted"
    assert cli(["convert", src, str(dst), "--max-shard-size", size]) == 2
    err = capsys.readouterr().err
    assert f"--max-shard-size={size!r}: give bytes as an int (100000), or a number with a unit" in err, err
    assert "'2G'" in err and "KiB" in err
    assert not dst.exists()


def test_parse_size_takes_ints_digits_and_units():
    from critic_adapters.common.valuehead.safetensors_stream import parse_size

    assert [parse_size(s) for s in (100000, "100000", "2G", "2GB", "2gb", "500MB", "500M", "3KB", "2GiB", "1MiB",
                                    " 1.5 GB ", "7B", "1T")] == \
           [100000, 100000, 2 * 10**9, 2 * 10**9, 2 * 10**9, 5 * 10**8, 5 * 10**8, 3000, 2 * 2**30, 2**20,
            15 * 10**8, 7, 10**12]
    for bad in ("five", "0", "nan", "inf", 0, -5, 2.5, True, None):
        with pytest.raises(ValueError, match=r"trainer.export_max_shard_size=.*: give bytes as an int"):
            parse_size(bad, key="trainer.export_max_shard_size")


def test_module_entry_point_prints_values(tmp_path):
    path, _ = build.causal_lm(str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "critic_adapters.common.valuehead", "values", path, "--tokens", "5 6 7"],
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr
    assert "values  [" in result.stdout and "(shape [1, 3], torch.float32)" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "critic_adapters.common.valuehead", "values", path, "--tokens", "5 99999"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert bad.returncode == 2 and "--tokens must be ids in [0, 1000)" in bad.stderr


if __name__ == "__main__":
    run_pytest(__file__)
