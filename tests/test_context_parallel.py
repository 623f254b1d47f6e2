"""Context parallelism on the megatron backend (engine.parallel.context=2, 2 gloo ranks) gives what
the engine gives without it: the same values (<= 1e-5) for a qwen2 and a llama critic, packed and
padded, with sequences that straddle the split and sequences of one token; the same loss (<= 1e-5)
and grad norm (<= 1e-4 relative) for one update and for forward_backward, the same 5-step loss
curve (<= 1e-4); a naive split (no K/V gather) is caught; a CP-2 checkpoint resumes at CP 1.

The reference is the same 2 ranks as data parallel (context=1): each CP rank holds half of every
sequence of all the rows, each DP rank all of half the rows. One torchrun of 2 ranks for the
comparisons of both families and the CP-2 save, one of 1 rank for the resume.
"""

import json

import pytest
import torch

from critic_adapters.common.testdata import save_tiny_causal_lm, tiny_config
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun, then, worker_env

WORKER = "critic_adapters.tests.context_parallel_worker"
PACKINGS = ("True", "False")
STEPS = 5


def _run(nproc: int, *args: str) -> None:
    run_torchrun(nproc, WORKER, *args, env=worker_env(PYTHONWARNINGS="ignore"))


FAMILIES = ("qwen2", "llama")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """One torchrun of 2 ranks for every 2-rank run: the comparison per family, then the CP-2 half of
    the checkpoint round trip. {family: its comparison, "save": the save round, "root": its dir}."""
    spec = json.dumps({"packings": [True, False], "steps": STEPS, "layouts": {
        "cp1": {"context": 1}, "cp2": {"context": 2}, "control": {"context": 2, "control": True}}})
    runs, outs = [], {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(f"cp_{family}")
        outs[family] = root / "compared.pt"
        runs.append(["compare", outs[family], spec, save_tiny_causal_lm(family, str(root / "model")), root])
    root = tmp_path_factory.mktemp("cp_checkpoint")
    outs["save"] = root / "save.pt"
    runs.append(["save", outs["save"], "{}", save_tiny_causal_lm("qwen2", str(root / "model")), root])
    _run(2, *then(*runs))
    return {**{name: torch.load(out, weights_only=False) for name, out in outs.items()}, "root": root}


@pytest.fixture(scope="module", params=FAMILIES)
def compared(request, two_rank_runs):
    return two_rank_runs[request.param]


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask.bool()].max())


def test_values_at_context_2_are_those_at_context_1(compared):
    for packing in PACKINGS:
        want, got = compared[packing]["cp1"], compared[packing]["cp2"]
        assert _max_diff(got["straddling"], want["straddling"], want["mask"]) <= 1e-5, packing
        assert float((got["one_token"] - want["one_token"]).abs().max()) <= 1e-5, packing
        assert float(want["straddling"].abs().max()) > 1e-3  # the values are not all zero


def test_one_update_and_forward_backward_match_context_1(compared):
    for packing in PACKINGS:
        want, got = compared[packing]["cp1"], compared[packing]["cp2"]
        first, ref = got["updates"][0], want["updates"][0]
        assert abs(first["value_loss"] - ref["value_loss"]) <= 1e-5, (packing, first, ref)
        assert abs(first["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (packing, first, ref)
        # Metrics count each data-parallel share once, not once per context-parallel rank.
        assert first["valid_tokens"] == ref["valid_tokens"]
        assert abs(first["explained_variance"] - ref["explained_variance"]) <= 1e-5
        fb, fb_ref = got["forward_backward"], want["forward_backward"]
        assert abs(fb["loss"] - fb_ref["loss"]) <= 1e-5 * max(1.0, abs(fb_ref["loss"])), (packing, fb, fb_ref)
        assert abs(fb["grad_norm"] - fb_ref["grad_norm"]) <= 1e-4 * fb_ref["grad_norm"], (packing, fb, fb_ref)


def test_five_steps_follow_the_context_1_loss_curve(compared):
    for packing in PACKINGS:
        want = [m["value_loss"] for m in compared[packing]["cp1"]["updates"]]
        got = [m["value_loss"] for m in compared[packing]["cp2"]["updates"]]
        assert len(got) == STEPS and want[-1] < want[0]  # the curve moves, so following it means something
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4, (packing, got, want)


def test_a_naive_split_without_the_key_value_gather_is_caught(compared):
    for packing in PACKINGS:
        want, naive = compared[packing]["cp1"], compared[packing]["control"]
        assert _max_diff(naive["straddling"], want["straddling"], want["mask"]) > 1e-2, packing


@pytest.fixture(scope="module")
def resumed(two_rank_runs):
    root = two_rank_runs["root"]
    out = root / "resume.pt"
    _run(1, "resume", str(out), "{}", str(root / "model"), str(root))
    return {"save": two_rank_runs["save"], "resume": torch.load(out, weights_only=False), "export": root / "hf_export"}


def test_a_context_2_checkpoint_resumes_at_context_1(resumed):
    from safetensors.torch import load_file

    saved, loaded = resumed["save"], resumed["resume"]
    assert float((saved["values"] - loaded["values"]).abs().max()) <= 1e-6
    assert saved["weights"].keys() == loaded["weights"].keys()
    assert all(torch.equal(saved["weights"][k], loaded["weights"][k]) for k in saved["weights"])
    # The export at CP 2 is the plain HF critic holding those weights.
    exported = load_file(str(resumed["export"] / "model.safetensors"))
    assert exported.keys() == saved["weights"].keys()
    assert all(torch.equal(exported[k].float(), saved["weights"][k]) for k in exported)
    nxt, ref = loaded["next"], saved["next"]
    assert abs(nxt["value_loss"] - ref["value_loss"]) <= 1e-5, (nxt, ref)
    assert abs(nxt["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (nxt, ref)


def test_a_world_that_does_not_divide_by_the_context_degree_is_refused():
    from critic_adapters.backends.megatron.config import check_megatron_config
    from critic_adapters.common.engine.config import ParallelConfig

    with pytest.raises(ValueError, match=r"tensor \* pipeline \* context = 4; launch a multiple of 4"):
        check_megatron_config(tiny_config("qwen2"), ParallelConfig(tensor=2, context=2), world_size=2)
    with pytest.raises(ValueError, match=r"engine\.parallel\.context=2, ulysses=1"):
        check_megatron_config(tiny_config("qwen2"), ParallelConfig(ulysses=2), world_size=2)


if __name__ == "__main__":
    run_pytest(__file__)
