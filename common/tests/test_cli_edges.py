"""Edges of python -m critic_adapters.common.valuehead and load_critic: refused destinations are left untouched and
checked before any model is loaded; corrupt weights are named; values for a whole rollout file."""

import json
import os
import struct

import pyarrow.parquet as pq
import pytest
import torch

from critic_adapters.common.learning.data import make_default_records
from critic_adapters.common.engine import shift_to_tokens
from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import read_only_dir, run_pytest, tree_snapshot
from critic_adapters.common.valuehead import CriticLoadError, load_critic
from critic_adapters.common.valuehead import cli as cli_module
from critic_adapters.common.valuehead.cli import main as cli
from critic_adapters.common.valuehead.values import compute_values


def test_demo_onto_a_non_empty_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "critic"
    out.mkdir()
    (out / "config.json").write_text("{}")
    before = tree_snapshot(out)
    assert cli(["demo", str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert tree_snapshot(out) == before


def test_demo_makes_a_tiny_critic_with_a_real_tokenizers_vocabulary(tmp_path, capsys):
    """issue 49: a tiny model whose vocabulary is a real tokenizer's (Qwen2's 151936 ids), so real token
    ids fit, for a job's engine.model.path; smaller than the tiny config's own is refused, nothing written."""
    out = tmp_path / "tiny"
    assert cli(["demo", str(out), "--vocab-size", "151936"]) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 151936
    assert cli(["values", str(out), "--tokens", "151643 42 151645"]) == 0  # Qwen2's <|endoftext|>, <|im_end|>
    assert "values" in capsys.readouterr().out
    assert cli(["demo", str(tmp_path / "small"), "--vocab-size", "10"]) == 2
    assert "the tiny qwen2 model needs at least 1000 ids" in capsys.readouterr().err
    assert not (tmp_path / "small").exists()


def test_convert_onto_a_read_only_destination_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    src, _ = build.trl_value_head(str(tmp_path / "src"))
    parent = tmp_path / "ro"
    parent.mkdir()

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the destination was checked")

    monkeypatch.setattr(cli_module, "load_critic", no_load)
    with read_only_dir(str(parent)):
        assert cli(["convert", src, str(parent / "dst")]) == 2
        err = capsys.readouterr().err
        assert f"cannot write {parent / 'dst'}" in err and "choose another destination" in err
        assert os.listdir(parent) == []


def test_values_tokens_take_commas_or_spaces(tmp_path, capsys):
    path, _ = build.causal_lm(str(tmp_path))
    for tokens in ("5,6,7", "5, 6, 7", "5 6 7"):
        assert cli(["values", path, "--tokens", tokens]) == 0
        assert "tokens  [5, 6, 7]" in capsys.readouterr().out
    assert cli(["values", path, "--tokens", "5;6"]) == 2
    assert "integer token ids separated by spaces or commas" in capsys.readouterr().err


def _rewrite_header(path, key, shape):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(length)), f.read()
    header[key]["shape"] = shape
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("shape,message", [
    ([64, 32], r"model.safetensors: the header says tensor model.layers.0.self_attn.q_proj.weight is F32 of shape "
               r"\[64, 32\] \(8192 bytes\), but its data holds 16384 bytes"),
    ([32, 128], r"model.layers.0.self_attn.q_proj.weight is \[32, 128\] in model.safetensors, the model needs "
                r"\[64, 64\]"),
])
def test_a_header_that_lies_about_a_shape_names_file_and_tensor(tmp_path, shape, message):
    path, _ = build.causal_lm(str(tmp_path))
    _rewrite_header(os.path.join(path, "model.safetensors"), "model.layers.0.self_attn.q_proj.weight", shape)
    with pytest.raises(CriticLoadError, match=message):
        load_critic(path)


@pytest.mark.parametrize("tensor,named", [
    ("model.norm.weight", "model.norm.weight"),
    ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("v_head.summary.weight", "score.weight"),
])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, tensor, named):
    from safetensors.torch import load_file, save_file

    path, _ = build.trl_value_head(str(tmp_path))
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    state[tensor].view(-1)[0] = float("nan")
    save_file(state, weights)
    with pytest.raises(CriticLoadError, match=rf"tensor {named} holds 1 NaN/inf value"):
        load_critic(path)


def test_values_for_a_whole_rollout_file(tmp_path, capsys):
    path, _ = build.causal_lm(str(tmp_path / "model"))
    records = make_default_records(5)
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "values.parquet"
    assert cli(["values", path, "--rollouts", str(rollouts), "--out", str(out), "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}: values for 5 rollouts" in captured.out and "5/5" in captured.err  # the progress bar
    table = pq.read_table(out).to_pylist()
    assert [r["input_ids"] for r in table] == [r["input_ids"] for r in records]
    model, _ = load_critic(path)
    ids = torch.tensor([records[3]["input_ids"]])
    with torch.no_grad():
        expected = shift_to_tokens(compute_values(model, ids, torch.ones_like(ids)))[0]
    assert torch.allclose(torch.tensor(table[3]["values"]), expected, atol=1e-5)
    # Bad rows are named like in training, and an existing --out is never overwritten.
    records[1]["input_ids"][2] = 1.5
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in records))
    before = tree_snapshot(tmp_path)
    assert cli(["values", path, "--rollouts", str(rollouts), "--out", str(tmp_path / "new.parquet")]) == 2
    assert f"invalid rollouts in {rollouts}" in capsys.readouterr().err
    assert cli(["values", path, "--rollouts", str(rollouts), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert tree_snapshot(tmp_path) == before


def test_values_for_a_rollout_file_with_images(tmp_path, capsys):
    """A vision critic's values over a rollout file with images are those computed with the images; a
    text-only critic refuses the images by name and writes nothing; so does the vision critic for the
    same rows without their images (the file without the column, or every row's null: issue 49), as
    compute_values does."""
    from critic_adapters.common.job.vision_rollouts import make_vision_records
    from critic_adapters.common.testdata import save_tiny_causal_lm

    records = make_vision_records(3)
    for r in records:
        r["multi_modal_inputs"] = {k: v.tolist() for k, v in r["multi_modal_inputs"].items()}
    rollouts = tmp_path / "images.jsonl"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in records))
    path = save_tiny_causal_lm("qwen2_vl", str(tmp_path / "vlm"))
    out = tmp_path / "values.parquet"
    assert cli(["values", path, "--rollouts", str(rollouts), "--out", str(out)]) == 0
    table = pq.read_table(out).to_pylist()
    model, _ = load_critic(path)
    ids = torch.tensor([records[1]["input_ids"]])
    images = [{k: torch.tensor(v) for k, v in records[1]["multi_modal_inputs"].items()}]
    with torch.no_grad():
        expected = shift_to_tokens(compute_values(model, ids, torch.ones_like(ids), multi_modal_inputs=images))[0]
        zeroed = [dict(images[0], pixel_values=torch.zeros_like(images[0]["pixel_values"]))]
        blind = shift_to_tokens(compute_values(model, ids, torch.ones_like(ids), multi_modal_inputs=zeroed))[0]
        with pytest.raises(ValueError, match=r"row 0: input_ids hold 4 image placeholder token\(s\) \(id 998\) but "
                                             r"the row has no pixel_values \(no row was given multi_modal_inputs"):
            compute_values(model, ids, torch.ones_like(ids))
    assert torch.allclose(torch.tensor(table[1]["values"]), expected, atol=1e-5)
    assert not torch.allclose(torch.tensor(table[1]["values"]), blind, atol=1e-4)
    # The whole file without its images, and one null row after a first batch of one row (named as the file's row 2).
    for form, rows, change, first in (("no-column", range(3), lambda r: r.pop("multi_modal_inputs"), 0),
                                      ("null", range(3), lambda r: r.update(multi_modal_inputs=None), 0),
                                      ("one-null", [2], lambda r: r.update(multi_modal_inputs=None), 2)):
        blind_file = tmp_path / f"{form}.jsonl"
        blind_records = [dict(r) for r in records]
        for row in rows:
            change(blind_records[row])
        blind_file.write_text("".join(json.dumps(r) + "\n" for r in blind_records))
        capsys.readouterr()
        assert cli(["values", path, "--rollouts", str(blind_file), "--out", str(tmp_path / f"{form}.parquet"),
                    "--batch-size", "2"]) == 2
        error = capsys.readouterr().err
        assert f"invalid rollouts in {blind_file}: row {first}: input_ids hold 4 image placeholder token(s)" in error, error
        assert not (tmp_path / f"{form}.parquet").exists()
    text_critic, _ = build.causal_lm(str(tmp_path / "text"))
    capsys.readouterr()
    assert cli(["values", text_critic, "--rollouts", str(rollouts), "--out", str(tmp_path / "no.parquet")]) == 2
    assert "text-only and cannot see them" in capsys.readouterr().err
    assert not (tmp_path / "no.parquet").exists()


if __name__ == "__main__":
    run_pytest(__file__)
