"""save_critic writes a plain HF *ForTokenClassification that transformers loads cleanly."""

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import assert_close_on_mask, padded_batch, run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic, save_critic
from critic_adapters.common.valuehead.config import GENERIC_ARCHITECTURE


@pytest.mark.parametrize("builder", [build.trl_value_head, build.openrlhf, build.megatron_export])
def test_round_trip_through_plain_transformers(tmp_path, builder):
    src, _ = builder(str(tmp_path))
    model, _ = load_critic(src)
    out = save_critic(model, str(tmp_path / "critic"))
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen2ForTokenClassification"] and config.num_labels == 1
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    plain, info = AutoModelForTokenClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids, mask = padded_batch()
    with torch.no_grad():
        assert_close_on_mask(plain(input_ids=ids, attention_mask=mask).logits.squeeze(-1),
                             compute_values(model, ids, mask), mask, atol=1e-6)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2_vl", "gpt_neox"])
def test_families_round_trip_through_load_critic(tmp_path, family):
    src, _ = build.causal_lm(str(tmp_path), family)
    model, _ = load_critic(src)
    out = save_critic(model, str(tmp_path / "critic"))
    config = json.load(open(os.path.join(out, "config.json")))
    generic = family != "gpt_neox"
    assert config["architectures"] == [GENERIC_ARCHITECTURE if generic else "GPTNeoXForTokenClassification"]
    again, report = load_critic(out)
    assert report.head == "loaded" and report.missing_keys == [] and report.unexpected_keys == []
    assert report.format == ("generic-token-classification" if generic else "hf-token-classification")
    ids, mask = padded_batch()
    with torch.no_grad():
        assert torch.allclose(compute_values(again, ids, mask), compute_values(model, ids, mask), atol=1e-6)


def test_bf16_critic_saves_bf16_and_values_stay_float32(tmp_path):
    src, _ = build.trl_value_head(str(tmp_path))
    model, report = load_critic(src, torch_dtype=torch.bfloat16)
    assert report.dtype == "bfloat16" and next(model.parameters()).dtype == torch.bfloat16
    ids, mask = padded_batch()
    with torch.no_grad():
        values = compute_values(model, ids, mask)
    assert values.dtype == torch.float32
    out = save_critic(model, str(tmp_path / "critic-bf16"))
    again, _ = load_critic(out, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(compute_values(again, ids, mask), values)


def test_existing_directory_is_kept_unless_overwrite(tmp_path):
    src, _ = build.megatron_export(str(tmp_path))
    model, _ = load_critic(src)
    out = tmp_path / "critic"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        save_critic(model, str(out))
    assert sorted(os.listdir(out)) == ["precious.txt"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p], "staging directory left behind"
    save_critic(model, str(out), overwrite=True)
    assert "precious.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


def test_a_sharded_save_is_what_transformers_writes_and_reads(tmp_path):
    """max_shard_size cuts the files as transformers names them; safetensors and plain transformers
    read them back; tensors may arrive in any order; a missing, doubled or misshapen tensor fails."""
    from safetensors.torch import load_file

    from critic_adapters.common.valuehead.safetensors_stream import TensorSpec, parse_size
    from critic_adapters.common.valuehead.save import write_critic

    path, _ = build.token_classification(str(tmp_path / "src"))
    model, _ = load_critic(path)
    state = model.state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values())
    out = save_critic(model, str(tmp_path / "sharded"), max_shard_size=size // 3)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-0000{len(files)}.safetensors" for k in range(1, len(files) + 1)]
    assert len(files) >= 3 and index["metadata"]["total_size"] == size
    read = {}
    for file in files:  # safetensors' own reader checks the header and the offsets
        read.update(load_file(os.path.join(out, file)))
    assert set(read) == set(state) and all(torch.equal(read[k], state[k]) for k in state)
    plain = AutoModelForTokenClassification.from_pretrained(out).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        assert_close_on_mask(plain(input_ids=ids, attention_mask=mask).logits.squeeze(-1),
                             compute_values(model, ids, mask), mask, 1e-6)

    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    write_critic(model.config, str(tmp_path / "reversed"), specs, reversed(list(state.items())))
    assert all(torch.equal(t, state[k]) for k, t in load_file(str(tmp_path / "reversed" / "model.safetensors")).items())
    # A tensor that arrives by row blocks (its shards, in any order) is written in place.
    big = max(state, key=lambda k: state[k].numel())
    rows = state[big].shape[0]
    blocks = [(big, state[big][rows // 3:], rows // 3), (big, state[big][:rows // 3], 0)]
    write_critic(model.config, str(tmp_path / "rows"), specs, [*blocks, *((k, t) for k, t in state.items() if k != big)])
    assert torch.equal(load_file(str(tmp_path / "rows" / "model.safetensors"))[big], state[big])
    items = list(state.items())
    for name, tensors, problem in [("missing", items[:-1], "missing 1 tensors"),
                                   ("rows_twice", items + [blocks[1]], "written twice"),
                                   ("overlap", [blocks[0], blocks[0], *(i for i in items if i[0] != big)],
                                    "more rows written"),
                                   ("twice", items + items[:1], "written twice"),
                                   ("shape", [(items[0][0], items[0][1][:1])] + items[1:], "laid out as")]:
        with pytest.raises(ValueError, match=problem):
            write_critic(model.config, str(tmp_path / name), specs, iter(tensors))
        assert not os.path.exists(tmp_path / name)  # nothing half-written
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(7) == 7
    with pytest.raises(ValueError, match="give bytes as an int .* like '5GB', '500MB', '2G'"):
        parse_size("five")


def test_convert_streams_into_sharded_files(tmp_path, capsys):
    """The CLI's convert reads each tensor from the source's files and writes it at once (no whole
    model), cut at --max-shard-size; the result equals load_critic's critic."""
    from critic_adapters.common.valuehead.cli import main

    path, _ = build.trl_value_head(str(tmp_path / "src"))
    model, _ = load_critic(path)
    out = str(tmp_path / "out")
    assert main(["convert", path, out, "--max-shard-size", "100KB"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    again, report = load_critic(out)
    assert report.format == "hf-token-classification"
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in again.state_dict().items())


def test_writing_and_reading_tensors_leaves_their_storages_resizable(tmp_path):
    """Issue 40, 1: the streaming writer once wrote through numpy, which marks the written tensor's
    storage non-resizable for good; a megatron parameter written so was later re-pointed by offload,
    which cut its gradient hook. Neither the writer nor the sliced reader may change the flag, and an
    engine whose tensors must not be re-pointed refuses such a storage instead of re-pointing it."""
    from critic_adapters.common.engine.offload import StorageOffload
    from critic_adapters.common.valuehead.safetensors_stream import TensorSpec, write_streaming
    from critic_adapters.common.valuehead.sliced import _data_locations, read_rows

    weight = torch.randn(4, 3)
    write_streaming(str(tmp_path), [TensorSpec("w", (4, 3), torch.float32)], [("w", weight)])
    assert weight.untyped_storage().resizable()
    rows = read_rows(_data_locations(str(tmp_path / "model.safetensors"))["w"], 1, 3)
    assert torch.equal(rows, weight[1:3]) and rows.untyped_storage().resizable()

    aliased = torch.randn(4)
    aliased.numpy()  # what the writer did
    with pytest.raises(RuntimeError, match="cannot be resized"):
        StorageOffload().offload({"model": [aliased]}, {"model"}, repoint=False)
    kept = aliased.clone()
    StorageOffload().offload({"model": [aliased]}, {"model"})  # an engine that may re-point: an owned copy, freed
    assert aliased.untyped_storage().nbytes() == 0 and kept.numel() == 4


if __name__ == "__main__":
    run_pytest(__file__)
