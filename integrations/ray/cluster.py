"""Joining a Ray cluster, or starting a local one that is safe on a locked-down machine.

A local cluster started here listens on loopback only (127.0.0.1), runs no dashboard (the core ray
package has none; it needs no extra), sends no usage statistics, and keeps Ray's own defaults
otherwise: its session files under the system temp dir (Ray's `ray` folder there), and its token
authentication as Ray 2.60 sets it up (on: it writes ~/.ray/auth_token; we never turn it off —
RAY_AUTH_MODE is the user's to set).
"""

from __future__ import annotations

import os

_STARTED = {"local": False}


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """ray.init unless Ray is initialised: `address` joins an existing cluster ("auto", "ray://...",
    "host:port"); without one, a local cluster on this machine (loopback only)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    _STARTED["local"] = True


def check_fits(num_workers: int, resources: dict) -> None:
    """ValueError unless the cluster has, in all, `num_workers` times `resources` (per worker): a
    placement group it can never place would otherwise wait for resources that never come."""
    import ray

    total = ray.cluster_resources()
    short = {name: amount for name, amount in resources.items() if amount and num_workers * amount > total.get(name, 0)}
    if short:
        asked = ", ".join(f"{amount:g} {name}" for name, amount in short.items())
        has = ", ".join(f"{total.get(name, 0):g} {name}" for name in short)
        raise ValueError(f"{num_workers} workers of {asked} asked, the cluster has {has} in all: start fewer workers "
                         f"(--nproc), reserve less per worker (--cpus-per-worker / --gpus-per-worker), or join a "
                         f"bigger cluster (--address)")


def started_locally() -> bool:
    """The cluster is one this process started on loopback (its workers' rendezvous uses 127.0.0.1),
    or one whose only node is this machine's loopback."""
    import ray

    if _STARTED["local"]:
        return True
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    return len(nodes) == 1 and nodes[0].get("NodeManagerAddress") == "127.0.0.1"


def shutdown_ray() -> None:
    """ray.shutdown() of a cluster this process started (a joined one is left running)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _STARTED["local"] = False
