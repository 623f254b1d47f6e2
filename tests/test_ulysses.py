"""Ulysses sequence parallelism (common/parallel/ulysses.py) on the fsdp and veomni engines, 2 gloo ranks:
ulysses=2 against ulysses=1 on the same rows, for a qwen2 critic (4 query heads, 2 KV heads) and a
llama critic with a single KV head (replicated for the two ranks, and run with gradient
checkpointing, so the backward recomputes the split attention), packed and padded; and two naive
splits that must fail the same comparison."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from critic_adapters.common.parallel import ulysses
from critic_adapters.common.testdata import save_tiny_causal_lm, tiny_config
from critic_adapters.common.tests.helpers import run_pytest, save_rollout_batch
from critic_adapters.common.tests.torchrun import run_launcher_in_process, run_torchrun, worker_env
from critic_adapters.tests.ulysses_worker import LENGTHS, STEPS

BACKENDS = ("fsdp", "veomni")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ulysses_models")
    qwen2 = save_tiny_causal_lm("qwen2", str(root / "qwen2"))
    config = tiny_config("llama")
    config.num_key_value_heads = 1  # fewer KV heads than Ulysses ranks
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "llama"))
    return [qwen2, str(root / "llama")]


_DONE: dict[str, dict] = {}


@pytest.fixture(scope="module", params=BACKENDS)
def result(request, model_dirs, tmp_path_factory):
    backend = request.param
    if backend not in _DONE:
        work = tmp_path_factory.mktemp(f"ulysses_{backend}")
        run_torchrun(2, "critic_adapters.tests.ulysses_worker", backend, str(work), *model_dirs,
                     env=worker_env(PYTHONWARNINGS="ignore"))
        _DONE[backend] = torch.load(work / "result.pt")
    return _DONE[backend]


def masks(tmp_path):
    batch = save_rollout_batch(str(tmp_path / "b.pt"), LENGTHS, seed=3)
    short = save_rollout_batch(str(tmp_path / "s.pt"), [1], seed=3)
    return batch["attention_mask"].bool(), short["attention_mask"].bool()


def value_diff(a, b, mask) -> float:
    return float((a - b).abs()[mask].max())


CASES = [(family, packing) for family in ("qwen2", "llama") for packing in (True, False)]


@pytest.mark.parametrize("family,packing", CASES, ids=[f"{f}-{'packed' if p else 'padded'}" for f, p in CASES])
def test_values_and_updates_equal_ulysses_1(result, family, packing, tmp_path):
    mask, short_mask = masks(tmp_path)
    one, two = result[(family, packing)][1], result[(family, packing)][2]
    assert value_diff(two["values"], one["values"], mask) <= 1e-5
    assert value_diff(two["short_values"], one["short_values"], short_mask) <= 1e-5
    # Padding positions stay zero, as without SP.
    assert float(two["values"][~mask].abs().max()) == 0.0
    first1, first2 = one["metrics"][0], two["metrics"][0]
    assert abs(first2["value_loss"] - first1["value_loss"]) <= 1e-5, (first2["value_loss"], first1["value_loss"])
    assert abs(first2["grad_norm"] - first1["grad_norm"]) <= 1e-4 * first1["grad_norm"]
    # Five steps follow the same curve, and the critic learned something on the way.
    curve1 = [m["value_loss"] for m in one["metrics"]]
    curve2 = [m["value_loss"] for m in two["metrics"]]
    assert len(curve2) == STEPS and max(abs(a - b) for a, b in zip(curve1, curve2)) <= 1e-4, (curve1, curve2)
    assert curve2[-1] < curve2[0]
    assert value_diff(two["values_after"], one["values_after"], mask) <= 1e-4


@pytest.mark.parametrize("kind", ["local", "across"])
def test_a_naive_split_fails_the_comparison(result, kind, tmp_path):
    """Attention over a rank's own columns (no all-to-all), or across packed sequences, gives other values."""
    mask, _ = masks(tmp_path)
    reference = result[("qwen2", True)][1]["values"]
    assert value_diff(result["controls"][kind], reference, mask) > 1e-3


def test_heads_the_degree_cannot_split_are_refused():
    with pytest.raises(ValueError, match=r"ulysses=3 must divide the model's 4 attention heads"):
        ulysses.check_heads(4, 2, 3)
    with pytest.raises(ValueError, match=r"ulysses=4 and the model's 3 key/value heads"):
        ulysses.check_heads(12, 3, 4)
    ulysses.check_heads(4, 1, 2)  # fewer KV heads than ranks: replicated
    ulysses.check_heads(8, 4, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_launcher_refuses_a_degree_the_heads_cannot_take_before_starting(backend, tmp_path):
    """The default job's qwen2 has 4 attention heads: ulysses=3 is refused in one line, nothing written."""
    run_dir = tmp_path / "run"
    result = run_launcher_in_process(f"critic_adapters.backends.{backend}.train", "--nproc", "3", "engine.parallel.ulysses=3",
                          f"trainer.run_dir={run_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: engine.parallel.ulysses=3 must divide the model's 4 attention heads"), result.stderr[-3000:]
    assert not run_dir.exists()
    ok = run_launcher_in_process(f"critic_adapters.backends.{backend}.train", "--nproc", "4", "engine.parallel.ulysses=2",
                      "--dry-run", f"trainer.run_dir={run_dir}")
    assert ok.returncode == 0 and "processes: 4 (ulysses 2 x data parallel 2)" in ok.stdout, ok.stderr[-3000:]


if __name__ == "__main__":
    run_pytest(__file__)
