"""RayCriticGroup across Ray nodes: a ray.cluster_utils.Cluster of two raylets on this machine (one
CPU each), joined by address; the group's two workers land on different nodes, rendezvous on the
address Ray reports for them, and give the values and the update of the same group on one node.

The driver (two_node_driver.py) runs in a network namespace of its own with only loopback
(`unshare`): Ray then reports 127.0.0.1 for every node, and nothing leaves the machine's loopback."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest, save_rollout_batch
from critic_adapters.common.tests.torchrun import worker_env

LENGTHS = [12, 7, 10, 5, 9]


def loopback_only(command: list[str]) -> list[str]:
    """`command` in a new network namespace whose only interface is loopback (root: a network
    namespace; otherwise a user namespace with one)."""
    unshare = shutil.which("unshare")
    assert unshare, "the two-node test needs util-linux's unshare (a loopback-only network namespace)"
    flags = ["--net"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--net"]
    return [unshare, *flags, "sh", "-c", 'ip link set lo up 2>/dev/null || true; exec "$@"', "sh", *command]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_nodes")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    batch_file = str(root / "batch.pt")
    save_rollout_batch(batch_file, LENGTHS)
    out = root / "runs.pt"
    command = loopback_only([sys.executable, "-m", "critic_adapters.integrations.ray.tests.two_node_driver",
                             model_dir, batch_file, str(out)])
    result = subprocess.run(command, env=worker_env(PYTHONWARNINGS="ignore"), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"two-node driver failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def test_the_workers_are_spread_over_both_nodes_and_meet_at_the_addresses_ray_reports(runs):
    two = runs["two_nodes"]
    assert len(set(two["node_ids"])) == 2, two["node_ids"]
    assert two["hosts"] == two["node_addresses"] == ["127.0.0.1", "127.0.0.1"], two
    assert len(set(runs["one_node"]["node_ids"])) == 1


def test_values_and_one_update_across_nodes_equal_the_one_node_groups(runs):
    two, one = runs["two_nodes"], runs["one_node"]
    assert torch.equal(two["values"], one["values"])
    for key in ("value_loss", "grad_norm", "explained_variance", "valid_tokens"):
        assert two["metrics"][key] == one["metrics"][key], key
    assert torch.equal(two["after"], one["after"])
    assert not torch.equal(two["after"], two["values"])  # the update moved the critic


if __name__ == "__main__":
    run_pytest(__file__)
