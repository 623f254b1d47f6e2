"""python -m common.valuehead: inspect, convert, values, demo."""

import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForTokenClassification

from common.tests import checkpoint_builders as build
from common.tests.helpers import assert_close_on_mask, padded_batch, run_pytest
from common.valuehead.cli import main as cli


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


def test_module_entry_point_prints_values(tmp_path):
    path, _ = build.causal_lm(str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "common.valuehead", "values", path, "--tokens", "5 6 7"],
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr
    assert "values  [" in result.stdout and "(shape [1, 3], torch.float32)" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "common.valuehead", "values", path, "--tokens", "5 99999"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert bad.returncode == 2 and "--tokens must be ids in [0, 1000)" in bad.stderr


if __name__ == "__main__":
    run_pytest(__file__)
