"""DCP checkpoints reshard between world sizes and refuse other models; a killed save leaves the
previous checkpoint (the export as a plain HF critic with the engine's values: tests/conformance)."""

import math
import os
import shutil

import pytest
import torch

from critic_adapters.backends.fsdp.tests.launch import run_torchrun
from critic_adapters.backends.fsdp.tests.test_engine_parity import make_batch
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import then

WORKER = "critic_adapters.backends.fsdp.tests.checkpoint_worker"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    data = make_batch(str(root / "batch.pt"))
    return root, model_dir, data


@pytest.fixture(scope="module")
def worlds(inputs):
    """Saved on 2 ranks and loaded on 1, saved on 1 and loaded on 2, and another model's load of a
    1-rank checkpoint: three torchruns (the runs of one process count that can go together share one)."""
    root, model_dir, _ = inputs
    batch = str(root / "batch.pt")
    for name in ("2to1", "1to2", "other"):
        (root / name).mkdir()
    other = save_tiny_causal_lm("llama", str(root / "other-model"))
    run_torchrun(2, WORKER, "train-save", model_dir, batch, str(root / "2to1"))
    run_torchrun(1, WORKER, *then(("load-continue", model_dir, batch, root / "2to1"),
                                  ("train-save", model_dir, batch, root / "1to2"),
                                  ("train-save", model_dir, batch, root / "other"),
                                  ("load-other", other, batch, root / "other")))
    run_torchrun(2, WORKER, "load-continue", model_dir, batch, str(root / "1to2"))
    return root


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)])
def test_checkpoint_loads_on_another_world_size(inputs, worlds, save_world, load_world):
    _, _, data = inputs
    work = worlds / f"{save_world}to{load_world}"
    saved = torch.load(work / f"train-save-world{save_world}.pt")
    loaded = torch.load(work / f"load-continue-world{load_world}.pt")
    mask = data["attention_mask"].bool()
    assert loaded["extra"] == {"position": 3}
    # Same weights after loading (any world size) ...
    assert float((loaded["loaded"] - saved["saved"]).abs()[mask].max()) <= 1e-6
    # ... and the optimizer/scheduler state came along: the next step lands where the original run's did.
    assert float((loaded["continued"] - saved["continued"]).abs()[mask].max()) <= 1e-5
    assert float((loaded["continued"] - loaded["loaded"]).abs()[mask].max()) > 1e-4  # the step did something
    # Warmup 2 steps, then cosine over 10: the 4th step (index 3) is 1/8 into the decay.
    assert loaded["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 8)))


def test_checkpoint_of_another_model_is_refused(worlds):
    error = torch.load(worlds / "other" / "load-other-world1.pt")["error"]
    assert "belongs to another model" in error and "model_type" in error


def test_interrupted_save_keeps_the_previous_checkpoint(inputs):
    """A staging directory left by a killed save is never mistaken for a checkpoint."""
    from critic_adapters.common.storage import checkpoints

    root, model_dir, _ = inputs
    ckpts = root / "interrupted" / "checkpoints"
    good = ckpts / "step_000004"
    good.mkdir(parents=True)
    (good / checkpoints.META_FILE).write_text("{}")
    checkpoints.mark_latest(str(ckpts), str(good))
    half = ckpts / ".step_000008.tmp-abc"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoints.find_latest(str(ckpts)) == str(good)
    os.remove(ckpts / checkpoints.LATEST)
    (ckpts / "step_000006").mkdir()  # no marker: incomplete
    assert checkpoints.find_latest(str(ckpts)) == str(good)
    checkpoints.prune(str(ckpts), keep_last=2)
    assert not half.exists() and good.exists()
    shutil.rmtree(root / "interrupted")


if __name__ == "__main__":
    run_pytest(__file__)
