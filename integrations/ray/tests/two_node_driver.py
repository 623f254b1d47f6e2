"""Driver for test_two_nodes.py: a RayCriticGroup across two Ray nodes, then on one, same work.

argv: model_dir batch_file out_file. Run inside a network namespace of its own with only loopback
(test_two_nodes.py starts it under `unshare`), so every raylet, the GCS and the workers' gloo
rendezvous are on 127.0.0.1, the address Ray reports for both nodes.

  1. ray.cluster_utils.Cluster: a head and a second raylet, one CPU each; the group joins it by
     address (RayCriticGroup(address=...)), one worker per node (STRICT_SPREAD); values, one update.
  2. the cluster gone, a one-node local cluster of two CPUs; the same group, the same calls.
"""

import os
import sys

import torch

from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig
from critic_adapters.common.tests.helpers import FIELDS


def run_group(group_kwargs: dict, config: EngineConfig, batch: RolloutBatch) -> dict:
    import ray

    from critic_adapters.integrations.ray import RayCriticGroup

    with RayCriticGroup("fsdp", config, num_workers=2, **group_kwargs) as group:
        hosts = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        out = {"node_ids": list(group.node_ids), "hosts": list(group.hosts),
               "node_addresses": [hosts[node] for node in group.node_ids],
               "values": group.compute_values(batch.input_ids, batch.attention_mask)}
        out["metrics"] = group.update(batch)
        out["after"] = group.compute_values(batch.input_ids, batch.attention_mask)
    return out


def main() -> None:
    model_dir, batch_file, out_file = sys.argv[1:4]
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    import ray
    from ray.cluster_utils import Cluster

    from critic_adapters.integrations.ray.cluster import ensure_ray, shutdown_ray

    data = torch.load(batch_file)
    batch = RolloutBatch(*(data[key] for key in FIELDS))
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, grad_clip=1.0),
                          loss=LossConfig(clip_range=0.2), batching=BatchingConfig(micro_batch_tokens=48))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        two_nodes = run_group({"address": cluster.address, "placement_strategy": "STRICT_SPREAD"}, config, batch)
    finally:
        ray.shutdown()
        cluster.shutdown()
    ensure_ray(num_cpus=2)
    try:
        one_node = run_group({}, config, batch)
    finally:
        shutdown_ray()
    torch.save({"two_nodes": two_nodes, "one_node": one_node}, out_file)


if __name__ == "__main__":
    main()
