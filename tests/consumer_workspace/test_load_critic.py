"""From another workspace: `critic_adapters` comes from this test's runfiles (the external repository),
loads a critic and computes its values."""

import os
import sys

import torch

import critic_adapters
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.valuehead import compute_values, load_critic


def main() -> int:
    runfiles = os.path.realpath(os.environ["TEST_SRCDIR"])
    here = os.path.dirname(critic_adapters.__file__)
    assert os.path.abspath(here).startswith(os.environ["TEST_SRCDIR"]) or os.path.realpath(here).startswith(
        runfiles), f"critic_adapters came from {here}, not from the Bazel dependency in {runfiles}"
    path = save_tiny_causal_lm("qwen2", os.path.join(os.environ["TEST_TMPDIR"], "model"))
    model, report = load_critic(path)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    values = compute_values(model, ids, torch.ones_like(ids))
    assert values.shape == (1, 5) and values.dtype == torch.float32, values.shape
    assert report.format == "causal-lm" and report.head == "initialized", report
    print(f"critic_adapters from {here}: {report.critic_class}, values {values[0].tolist()}")
    print("1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
