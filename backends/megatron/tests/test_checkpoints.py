"""dist_checkpointing checkpoints: resuming gives bit-identical weights at the same layout, a TP2
checkpoint resumes at TP1 (and back) on the same loss curve, and export_hf writes a plain
*ForTokenClassification that loads with no missing or unexpected keys and computes the same values."""

import os

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.backends.megatron.tests.launch import run_torchrun
from critic_adapters.common.storage.checkpoints import META_FILE
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import save_rollout_batch, run_pytest
from critic_adapters.common.tests.torchrun import then

WORKER = "critic_adapters.backends.megatron.tests.checkpoint_worker"


def make_batch(path: str) -> None:
    save_rollout_batch(path, [17, 9, 20, 4, 13, 11])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A checkpoint saved at TP 1 and at TP 2, each resumed at both: three torchruns (the runs of one
    process count that can go together share one)."""
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    batch = str(root / "batch.pt")
    make_batch(batch)
    for saved_at in (1, 2):
        (root / f"tp{saved_at}").mkdir()

    def save(tp):
        return "save", model_dir, batch, root / f"tp{tp}", tp, root / f"tp{tp}" / "save.pt"

    def resume(saved_at, resumed_at):
        return "resume", model_dir, batch, root / f"tp{saved_at}", resumed_at, root / f"tp{saved_at}" / f"resume{resumed_at}.pt"

    run_torchrun(1, WORKER, *then(save(1), resume(1, 1)))
    run_torchrun(2, WORKER, *then(save(2), resume(2, 2), resume(1, 2)))
    run_torchrun(1, WORKER, *then(resume(2, 1)))
    results = {("save", tp): torch.load(save(tp)[-1]) for tp in (1, 2)}
    results.update({(saved, resumed): torch.load(resume(saved, resumed)[-1]) for saved in (1, 2) for resumed in (1, 2)})
    return root, results


def test_resume_at_the_same_layout_is_bit_identical(runs):
    _, results = runs
    for tp in (1, 2):
        saved, resumed = results[("save", tp)], results[(tp, tp)]
        for name, tensor in saved["weights"].items():
            assert torch.equal(resumed["weights"][name], tensor), f"TP{tp}: {name} differs after resume"
        assert [m["value_loss"] for m in resumed["metrics"]] == [m["value_loss"] for m in saved["metrics"][2:]]
        assert [m["lr"] for m in resumed["metrics"]] == [m["lr"] for m in saved["metrics"][2:]]
        assert resumed["load_warnings"] == [], resumed["load_warnings"]  # megatron-core's FutureWarnings (issue 49)


def test_resume_at_another_tensor_degree_continues_the_loss_curve(runs):
    _, results = runs
    for saved_at, resumed_at in ((2, 1), (1, 2)):
        saved, resumed = results[("save", saved_at)], results[(saved_at, resumed_at)]
        for got, want in zip(resumed["metrics"], saved["metrics"][2:]):
            assert abs(got["value_loss"] - want["value_loss"]) <= 1e-5, (saved_at, resumed_at, got, want)
            assert got["lr"] == want["lr"]
        worst = max(float((resumed["weights"][n] - t).abs().max()) for n, t in saved["weights"].items())
        assert worst <= 1e-5, f"TP{saved_at} -> TP{resumed_at}: weights differ by {worst}"


def test_checkpoint_is_complete_and_fingerprinted(runs):
    root, _ = runs
    ckpt = root / "tp2" / "ckpt"
    assert (ckpt / META_FILE).is_file() and (ckpt / "trainer_state.pt").is_file()
    assert not [n for n in os.listdir(root / "tp2") if ".tmp" in n], "a staging directory was left behind"


def test_export_loads_in_plain_transformers(runs):
    root, results = runs
    for tp in (1, 2):
        export = root / f"tp{tp}" / "hf_export"
        model, info = AutoModelForTokenClassification.from_pretrained(str(export), output_loading_info=True)
        assert type(model).__name__ == "Qwen2ForTokenClassification"
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        state = model.state_dict()
        for name, tensor in results[("save", tp)]["weights"].items():
            assert torch.equal(state[name], tensor), f"TP{tp} export: {name}"


if __name__ == "__main__":
    run_pytest(__file__)
