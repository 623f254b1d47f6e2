"""Issue 43, the job: rollouts with images (multi_modal_inputs) through the training job. The default job on
the embedded vision set (returns told by the image alone) learns on fsdp and VeOmni and resumes bit for
bit; with the pixels zeroed it learns nothing; Parquet and JSON lines read the same images; bad images
and images for a text-only critic are refused by row or by name before anything is written."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from critic_adapters.common.job.metrics import read_metrics
from critic_adapters.common.job.rollout_images import with_images_again
from critic_adapters.common.job.vision_rollouts import make_vision_records
from critic_adapters.common.learning.data import load_rollouts
from critic_adapters.common.learning.media import split_processor_batch
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.testdata.vision import vision_batch
from critic_adapters.common.tests.helpers import final_explained_variance, run_pytest
from critic_adapters.common.tests.torchrun import (assert_resume_from_a_checkpoint_is_identical, run_launcher,
                                                   run_launcher_in_process as launch)

FSDP = "critic_adapters.backends.fsdp.train"
VEOMNI = "critic_adapters.backends.veomni.train"
QUIET = ("trainer.tensorboard=false", "trainer.plot=false", "trainer.progress=false")
# The default job (common/job/default_job.yaml) with the tiny VLM on the embedded image set.
VISION_JOB = ("--nproc", "2", "engine.model.path=embedded:qwen2_vl", "data.train_path=embedded:vision", *QUIET)
ZEROED_JOB = ("--nproc", "2", "engine.model.path=embedded:qwen2_vl", "data.train_path=embedded:vision_zeroed", *QUIET)


def held_out_ev(run_dir) -> list[float]:
    return [row["explained_variance"] for row in read_metrics(str(run_dir / "metrics.jsonl")) if row["split"] == "eval"]


def test_the_default_vision_job_reads_the_images_and_resumes_bit_identically_on_fsdp(tmp_path):
    """The returns are the image's brightness: >= 0.8 held out (issue 43). The step-80 checkpoint is
    inside a PPO iteration (its old values renewed with the images), the resumed run reads the images
    from the data again (nothing of them is saved) and ends bit for bit like the whole run."""
    whole = assert_resume_from_a_checkpoint_is_identical(FSDP, tmp_path, *VISION_JOB, step=80)
    evals = held_out_ev(tmp_path / "whole")
    assert evals[0] < 0.1 and evals[-1] >= 0.8 and final_explained_variance(whole.stdout) >= 0.8, evals
    assert "Qwen2VLCriticForTokenClassification" in whole.stdout


def test_with_the_pixels_zeroed_the_critic_learns_nothing(tmp_path):
    """The control: the same rows, every pixel 0; the text carries nothing of the returns. Two epochs, as
    the VeOmni job below, which reaches 0.98 in them with the pixels."""
    result = run_launcher(FSDP, *ZEROED_JOB, "trainer.epochs=2", f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert max(held_out_ev(tmp_path / "run")) <= 0.3 and final_explained_variance(result.stdout) <= 0.3, \
        held_out_ev(tmp_path / "run")


def test_the_default_vision_job_reads_the_images_on_veomni(tmp_path):
    """Two epochs of it (measured 0.98 held out after them; one epoch alone, its schedule shorter: 0.76):
    the images read, the critic learns."""
    result = run_launcher(VEOMNI, *VISION_JOB, "trainer.epochs=2", f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-4000:]
    evals = held_out_ev(tmp_path / "run")
    assert evals[-1] >= 0.8 and final_explained_variance(result.stdout) >= 0.8, evals


def _plain(record: dict, pixels=lambda p: p.tolist()) -> dict:
    """A record with its images as a file holds them (nested lists; `pixels`: pixel_values' form)."""
    def plain(key, value):
        if not isinstance(value, torch.Tensor):
            return value
        return pixels(value) if key == "pixel_values" else value.tolist()

    if "multi_modal_inputs" not in record:  # a file without the column
        return record
    media = record["multi_modal_inputs"]
    return dict(record, multi_modal_inputs=None if media is None else {k: plain(k, v) for k, v in media.items()})


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(_plain(record)) + "\n")
    return str(path)


def write_parquet(path, records) -> str:
    # Rows of float32 (list(array)) make list<list<float>>, as docs/DATA.md writes them.
    pq.write_table(pa.Table.from_pylist([_plain(r, lambda p: list(p.numpy())) for r in records]), str(path))
    return str(path)


def test_parquet_and_jsonl_read_the_same_images(tmp_path):
    records = make_vision_records(6, seed=1)
    records[2]["multi_modal_inputs"] = None  # a text row among image rows
    schema = pq.read_schema(write_parquet(tmp_path / "r.parquet", records))
    column = schema.field("multi_modal_inputs").type  # a struct of lists of lists
    assert [(f.name, f.type.value_type.value_type) for f in column] == \
        [("pixel_values", pa.float32()), ("image_grid_thw", pa.int64())]
    a = load_rollouts(str(tmp_path / "r.parquet"), 1000)
    b = load_rollouts(write_jsonl(tmp_path / "r.jsonl", records), 1000)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rewards, b.rewards)
    assert [sorted(row) for row in a.multi_modal_inputs] == [sorted(row) for row in b.multi_modal_inputs]
    assert a.multi_modal_inputs[2] == {}
    for row, (x, y) in enumerate(zip(a.multi_modal_inputs, b.multi_modal_inputs)):
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), (row, key)
        if records[row]["multi_modal_inputs"] is not None:
            assert torch.equal(x["pixel_values"], records[row]["multi_modal_inputs"]["pixel_values"])
    assert (a.multi_modal_inputs[0]["pixel_values"].dtype, a.multi_modal_inputs[0]["image_grid_thw"].dtype) == \
        (torch.float32, torch.int64)
    part = a.select(torch.tensor([2, 0]))  # rows carry their images
    assert part.multi_modal_inputs[0] == {} and torch.equal(part.multi_modal_inputs[1]["pixel_values"],
                                                           a.multi_modal_inputs[0]["pixel_values"])
    assert a.select(torch.tensor([2])).multi_modal_inputs is None


def test_a_processor_batch_splits_into_rows():
    """The processor's batch (every image's patches in one pixel_values) back into each row's images."""
    config = tiny_config("qwen2_vl")
    ids, mask, images = vision_batch(config, [[(1, 4, 4)], [(1, 4, 6), (1, 2, 2)], [], [(1, 2, 4)]], seed=0, left=(1,))
    batch = {"input_ids": ids, "attention_mask": mask,
             "pixel_values": torch.cat([m["pixel_values"] for m in images if m]),
             "image_grid_thw": torch.cat([m["image_grid_thw"] for m in images if m])}
    rows = split_processor_batch(batch, config)
    for row, ids_row, mask_row, media in zip(rows, ids, mask, images):
        assert row["input_ids"] == ids_row[mask_row.bool()].tolist()
        assert (row["multi_modal_inputs"] is None) == (media is None)
        assert media is None or all(torch.equal(row["multi_modal_inputs"][k], media[k]) for k in media)


def _one_placeholder_too_many(records):
    ids = records[3]["input_ids"]
    ids[ids.index(tiny_config("qwen2_vl").image_token_id) - 1] = tiny_config("qwen2_vl").image_token_id


def _grid_without_pixels(records):
    del records[5]["multi_modal_inputs"]["pixel_values"]


def _ragged_pixels(records):
    records[7]["multi_modal_inputs"]["pixel_values"] = records[7]["multi_modal_inputs"]["pixel_values"].tolist()
    records[7]["multi_modal_inputs"]["pixel_values"][2] = records[7]["multi_modal_inputs"]["pixel_values"][2][:5]


def _no_images_column(records):
    for record in records:
        del record["multi_modal_inputs"]


def _all_null(records):
    for record in records:
        record["multi_modal_inputs"] = None


def _odd_grid(records):
    """[1, 16, 1]: 16 patches and 4 placeholders, as [1, 4, 4] has, but w is no multiple of the merge size 2."""
    records[2]["multi_modal_inputs"]["image_grid_thw"] = torch.tensor([[1, 16, 1]])


def _short_pixel_rows(records):
    records[4]["multi_modal_inputs"]["pixel_values"] = records[4]["multi_modal_inputs"]["pixel_values"][:, :-1]


WIDTH = 3 * 2 * 14**2  # channels x temporal_patch_size x patch_size**2 of the tiny qwen2_vl's processor
BLIND = "(no row was given multi_modal_inputs: pass each row's images, as the processor wrote them)"
BAD = {  # name: (change to the records, the refusal)
    "no-images-column": (_no_images_column, "row 0: input_ids hold 4 image placeholder token(s) (id 998) but the row "
                                            f"has no pixel_values {BLIND}"),
    "all-images-null": (_all_null, f"row 0: input_ids hold 4 image placeholder token(s) (id 998) but the row has no "
                                   f"pixel_values {BLIND}"),
    "odd-grid": (_odd_grid, "row 2: image_grid_thw has an entry [1, 16, 1]: h and w must be multiples of this "
                            "critic's spatial_merge_size 2"),
    "short-pixel-rows": (_short_pixel_rows, f"row 4: pixel_values has shape (16, {WIDTH - 1}); this critic's "
                                            f"processor makes rows of {WIDTH} values"),
    "one-placeholder-too-many": (_one_placeholder_too_many,
                                 "row 3: input_ids hold 5 image placeholder token(s) (id 998) but image_grid_thw "
                                 "[[1, 4, 4]] makes 4"),
    "grid-without-pixels": (_grid_without_pixels, "row 5: multi_modal_inputs has image_grid_thw without pixel_values"),
    "ragged-pixels": (_ragged_pixels, "row 7: multi_modal_inputs: pixel_values: expected a list of equal-length lists"),
    "unknown-key": (lambda records: records[1]["multi_modal_inputs"].update(pixels=[1.0]),
                    "row 1: multi_modal_inputs: unknown key 'pixels'"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("form", ["jsonl", "parquet"])
def test_bad_images_are_refused_naming_the_row_before_anything_is_written(tmp_path, case, form):
    change, message = BAD[case]
    records = make_vision_records(16, seed=0)
    change(records)
    path = (write_jsonl if form == "jsonl" else write_parquet)(tmp_path / f"rollouts.{form}", records)
    run_dir = tmp_path / "run"
    dry = launch(FSDP, "--dry-run", "engine.model.path=embedded:qwen2_vl", f"data.train_path={path}",
                 f"trainer.run_dir={run_dir}")
    assert dry.returncode == 2 and f"invalid rollouts in {path}" in dry.stderr and message in dry.stderr, \
        dry.stderr[-3000:]
    assert not run_dir.exists()


def test_images_for_a_text_only_critic_are_refused_by_name_before_anything_is_written(tmp_path):
    """A launch (its worker reads the rollouts) and a dry run, named before the placeholder ids could be
    blamed on the vocabulary."""
    run_dir = tmp_path / "run"
    result = run_launcher(FSDP, "engine.model.path=embedded:qwen2", "data.train_path=embedded:vision",
                          "data.num_rollouts=64", f"trainer.run_dir={run_dir}")
    message = ("invalid rollouts in embedded:vision: 64 of 64 rows (row 0 first) bring multi_modal_inputs "
               "(images/videos), but engine.model.path=embedded:qwen2 is qwen2, a text-only critic and cannot see "
               "them: use a vision-language critic")
    assert result.returncode != 0 and message in result.stderr, result.stderr[-3000:]
    assert not run_dir.exists()
    dry = launch(FSDP, "--dry-run", "data.train_path=embedded:vision", f"trainer.run_dir={run_dir}")
    assert dry.returncode == 2 and "engine.model.path=embedded:qwen2 is qwen2, a text-only critic" in dry.stderr


def test_a_launch_on_rollouts_without_their_images_is_refused_by_row_before_anything_is_written(tmp_path):
    """issue 49: the file without its multi_modal_inputs column, through a real launch (its worker reads the
    rollouts); and images under Ulysses, through the dry run (a vision critic's text rows run there)."""
    records = make_vision_records(16, seed=0)
    _no_images_column(records)
    path = write_jsonl(tmp_path / "blind.jsonl", records)
    run_dir = tmp_path / "run"
    result = run_launcher(FSDP, "engine.model.path=embedded:qwen2_vl", f"data.train_path={path}",
                          f"trainer.run_dir={run_dir}", *QUIET)
    assert result.returncode != 0 and f"invalid rollouts in {path}: {BAD['no-images-column'][1]}" in result.stderr, \
        result.stderr[-3000:]
    assert not run_dir.exists()
    dry = launch(FSDP, "--dry-run", "--nproc", "2", "engine.model.path=embedded:qwen2_vl", "data.train_path=embedded:vision",
                 "engine.parallel.ulysses=2", f"trainer.run_dir={run_dir}")
    assert dry.returncode == 2 and "images under engine.parallel.ulysses > 1" in dry.stderr, dry.stderr[-3000:]
    assert not run_dir.exists()


def test_a_row_with_images_is_never_cut_to_max_positions(tmp_path):
    """Cutting it could part placeholders from their pixels: refused even with truncate_to_max_positions."""
    path = write_jsonl(tmp_path / "r.jsonl", make_vision_records(4, seed=0))
    with pytest.raises(ValueError, match=r"row 0: input_ids has \d+ tokens, more than the model's "
                                         r"max_position_embeddings \(8\), and it has images: cutting it could part"):
        load_rollouts(path, 1000, max_positions=8, truncate=True)


def test_a_resume_dry_run_refuses_data_whose_rows_changed_as_the_resume_does(tmp_path):
    """issue 49: the dry run of a --resume reads the run's rollouts as the resume does (their images
    read again from the data): a file whose token ids changed since the run started is refused by both,
    and the run is left as it was."""
    records = make_vision_records(12, seed=0)
    path = write_jsonl(tmp_path / "rollouts.jsonl", records)
    run_dir = tmp_path / "run"
    short = ("engine.model.path=embedded:qwen2_vl", f"data.train_path={path}", f"trainer.run_dir={run_dir}",
             "trainer.epochs=1", "data.mini_batch_size=4", "trainer.save_every_steps=2", "trainer.export_hf=false", *QUIET)
    first = launch(FSDP, "--nproc", "1", *short)
    assert first.returncode == 0, first.stderr[-3000:]
    assert launch(FSDP, "--resume", "--dry-run", f"trainer.run_dir={run_dir}").returncode == 0
    records[4]["input_ids"][1] += 1
    write_jsonl(tmp_path / "rollouts.jsonl", records)
    before = sorted(p.name for p in run_dir.rglob("*"))
    for extra in (("--dry-run",), ()):
        resumed = launch(FSDP, "--resume", *extra, "--nproc", "1", f"trainer.run_dir={run_dir}", "trainer.epochs=2")
        assert resumed.returncode != 0 and "no longer holds the rollouts this run started from" in resumed.stderr, \
            (extra, resumed.stdout[-2000:], resumed.stderr[-2000:])
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_a_resume_refuses_data_whose_rows_changed(tmp_path):
    """--resume reads the images from the data again: rows that are no longer the run's are refused."""
    records = make_vision_records(8, seed=0)
    prepared = load_rollouts(write_jsonl(tmp_path / "a.jsonl", records), 1000)
    prepared.multi_modal_inputs = None  # as prepared_rollouts.pt holds them
    same = with_images_again(prepared, load_rollouts(str(tmp_path / "a.jsonl"), 1000), "a.jsonl", "prepared")
    assert torch.equal(same.multi_modal_inputs[0]["pixel_values"], records[0]["multi_modal_inputs"]["pixel_values"])
    records[4]["input_ids"][1] += 1
    changed = load_rollouts(write_jsonl(tmp_path / "b.jsonl", records), 1000)
    with pytest.raises(ValueError, match="--resume: b.jsonl no longer holds the rollouts this run started from"):
        with_images_again(prepared, changed, "b.jsonl", "prepared")


if __name__ == "__main__":
    run_pytest(__file__)
