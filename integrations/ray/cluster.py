"""Joining a Ray cluster, or starting a local one that is safe on a locked-down machine.

A local cluster started here listens on loopback only (127.0.0.1), runs no dashboard (the core ray
package has none; it needs no extra), sends no usage statistics, and keeps Ray's own defaults
otherwise. Ray turns a loopback node address into the machine's reachable one
(services.resolve_ip_for_localhost) unless its single-machine mode is on (ENABLE_RAY_CLUSTER off, the
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 of its Windows/macOS default): a local cluster turns that mode on
for its lifetime, in this process and the processes Ray starts, so the GCS, the raylet and every
worker's address is 127.0.0.1 (checked by integrations/ray/tests/test_group.py). Also: its session files under the system temp dir (Ray's `ray` folder there), and its token
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
    from ray._private import ray_constants

    _STARTED["single_machine"] = (os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR),
                                  ray_constants.ENABLE_RAY_CLUSTER)
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # this one (read when Ray needs the node's address)
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


def shutdown_ray() -> None:
    """ray.shutdown() of a cluster this process started (a joined one is left running)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if _STARTED["local"]:
        from ray._private import ray_constants

        variable, constant = _STARTED.pop("single_machine")
        if variable is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = variable
        ray_constants.ENABLE_RAY_CLUSTER = constant
    _STARTED["local"] = False
