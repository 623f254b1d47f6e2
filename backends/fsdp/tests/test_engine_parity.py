"""The FSDP engine's values, loss and gradients equal the plain critic's, on 1 and 2 ranks, packed or
padded, token-budget or fixed-size micro-batches."""

import pytest
import torch

from critic_adapters.backends.fsdp.tests.launch import run_torchrun
from critic_adapters.common.engine import shift_to_tokens
from critic_adapters.common.learning.loss import value_loss
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import save_rollout_batch, run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic

ATOL = 1e-5


def make_batch(path):
    return save_rollout_batch(path, [17, 9, 20, 4, 13, 11, 20])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    data = make_batch(str(root / "batch.pt"))
    runs = {}
    for world in (1, 2):
        out = root / f"world{world}.pt"
        run_torchrun(world, "critic_adapters.backends.fsdp.tests.parity_worker", model_dir, str(root / "batch.pt"), str(out))
        runs[world] = torch.load(out)
    return model_dir, data, runs


def reference(model_dir, data, agg_mode):
    """The plain (unsharded, padded, sdpa) critic: values, loss and gradients of the same mini-batch."""
    model, _ = load_critic(model_dir)
    model.train()
    values = compute_values(model, data["input_ids"], data["attention_mask"])
    loss, _ = value_loss(shift_to_tokens(values), data["old_values"], data["returns"], data["response_mask"],
                         clip_range=0.2, agg_mode=agg_mode, horizon=data["input_ids"].shape[1])
    loss.backward()
    return values.detach(), float(loss), {n: p.grad for n, p in model.named_parameters()}


def test_values_loss_and_gradients_match_the_plain_critic(setup):
    model_dir, data, runs = setup
    mask = data["attention_mask"].bool()
    refs = {mode: reference(model_dir, data, mode) for mode in ("token-mean", "seq-mean-token-mean")}
    checked = 0
    for world, results in runs.items():
        for name, result in results.items():
            ref_values, ref_loss, ref_grads = refs[result["agg_mode"]]
            label = f"world {world}, {name}"
            diff = float((result["values"] - ref_values).abs()[mask].max())
            assert diff <= ATOL, f"{label}: values differ by {diff}"
            assert abs(result["loss"] - ref_loss) <= ATOL, f"{label}: loss {result['loss']} vs {ref_loss}"
            assert set(result["grads"]) == set(ref_grads)
            worst = max(float((result["grads"][n] - g).abs().max()) for n, g in ref_grads.items())
            assert worst <= ATOL, f"{label}: gradients differ by {worst}"
            checked += 1
    assert checked == 2 * 7
    # The packed variants really ran our per-sequence attention, the padded ones sdpa.
    assert runs[2]["packed-budget"]["attn"] == "critic_packed_attention"
    assert runs[2]["padded-budget"]["attn"] == "sdpa"
    # Two ranks shard with FSDP2; a single rank has nothing to shard and runs the plain module.
    assert runs[2]["packed-budget"]["sharded"] and not runs[1]["packed-budget"]["sharded"]


def test_gradients_are_not_trivially_equal(setup):
    # Guard against a check that cannot fail: the two aggregation modes give different gradients.
    _, _, runs = setup
    a = runs[1]["packed-budget"]["grads"]
    b = runs[1]["packed-budget-seq-mean"]["grads"]
    assert max(float((a[n] - b[n]).abs().max()) for n in a) > 1e-4


if __name__ == "__main__":
    run_pytest(__file__)
