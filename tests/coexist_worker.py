"""torchrun worker for test_coexistence: engines that share a process with each other and with a
host that set up megatron's parallel state itself. Each rank writes WORKDIR/rank<r>.json.

  python -m critic_adapters.tests.coexist_worker MODEL_DIR WORKDIR
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as torch_dist
from megatron.core import parallel_state

from critic_adapters.common.engine.config import EngineConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import gloo_worker_threads, init_distributed, shutdown
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.tests.conformance.worker import engine_config, rollout


def values(engine, rank):
    batch = rollout(rank)
    return engine.compute_values(batch.input_ids, batch.attention_mask)


def two_engines_alive(backend, config, dist, workdir) -> dict:
    """A second engine of `backend` built while the first is alive loads its checkpoint; closing it
    leaves the first working."""
    first = build_engine(backend, config, dist)
    first.update(rollout(dist.rank))
    ckpt = os.path.join(workdir, f"{backend}_first")
    first.save_checkpoint(ckpt)
    second = build_engine(backend, config, dist)  # while the first is alive
    second.load_checkpoint(ckpt)
    out = {"second_vs_first": float((values(second, dist.rank) - values(first, dist.rank)).abs().max())}
    before = values(first, dist.rank)
    second.close()
    out["first_after_second_closed"] = float((values(first, dist.rank) - before).abs().max())
    first.update(rollout(dist.rank))  # still trains
    first.close()
    return out


def two_megatron_engines(config, dist, workdir) -> dict:
    out = two_engines_alive("megatron", config, dist, workdir)
    out["groups_left"] = parallel_state.model_parallel_is_initialized()
    return out


def host_parallel_state(config, dist) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    host_dp = parallel_state.get_data_parallel_group()
    engine = build_engine("megatron", config, dist)
    out = {"engine_dp_group_is_hosts": engine.dp_group is host_dp, "values_sum": float(values(engine, 0).sum())}
    engine.close()
    out["host_groups_kept"] = parallel_state.model_parallel_is_initialized()
    probe = torch.ones(1)
    torch_dist.all_reduce(probe, group=parallel_state.get_data_parallel_group())
    out["host_dp_all_reduce"] = float(probe)
    try:
        build_engine("megatron", EngineConfig(model=config.model, parallel=ParallelConfig(tensor=2)), dist)
        out["other_layout"] = None
    except ValueError as err:
        out["other_layout"] = str(err)
    parallel_state.destroy_model_parallel()
    return out


def fsdp_beside_megatron(config, dist) -> dict:
    fsdp = build_engine("fsdp", config, dist)
    megatron = build_engine("megatron", config, dist)
    out = {"values_diff": float((values(fsdp, dist.rank) - values(megatron, dist.rank)).abs().max())}
    losses = [engine.update(rollout(dist.rank))["value_loss"] for engine in (fsdp, megatron)]
    out["losses"] = losses
    megatron.close()
    out["fsdp_after_megatron_closed"] = fsdp.update(rollout(dist.rank))["value_loss"]
    fsdp.close()
    return out


def one_after_another(config, dist) -> dict:
    """An FSDP engine closed, then a megatron one; and the reverse: the same critic's values."""
    out = {}
    for first, second in (("fsdp", "megatron"), ("megatron", "fsdp")):
        engine = build_engine(first, config, dist)
        before = values(engine, dist.rank)
        engine.close()
        engine = build_engine(second, config, dist)
        out[f"{first}_then_{second}"] = float((values(engine, dist.rank) - before).abs().max())
        engine.close()
    return out


def checkpoints_between_fsdp_and_veomni(config, dist, workdir) -> dict:
    """The two FSDP2-based backends read each other's checkpoints (one DCP layout, HF names)."""
    out = {}
    for writer, reader in (("fsdp", "veomni"), ("veomni", "fsdp")):
        engine = build_engine(writer, config, dist)
        engine.update(rollout(dist.rank))
        ckpt = os.path.join(workdir, f"{writer}_checkpoint")
        engine.save_checkpoint(ckpt)
        saved = values(engine, dist.rank)
        engine.close()
        engine = build_engine(reader, config, dist)
        engine.load_checkpoint(ckpt)
        out[f"{writer}_to_{reader}"] = float((values(engine, dist.rank) - saved).abs().max())
        engine.close()
    return out


def two_veomni_engines_and_the_hosts_state(config, dist, workdir) -> dict:
    from veomni.distributed import parallel_state as veomni_state

    out = two_engines_alive("veomni", config, dist, workdir)
    out["state_left"] = veomni_state.is_parallel_state_initialized()
    host = veomni_state.init_parallel_state(dp_size=dist.world_size, dp_shard_size=dist.world_size,
                                            dp_mode="fsdp2", device_type="cpu", name=None)
    engine = build_engine("veomni", config, dist)
    # The engine's VeOmni state is its own, made from its mesh; the host's stays VeOmni's ambient one.
    out["engine_state_from_its_mesh"] = (engine.parallel_state is not host
                                         and engine.parallel_state.fsdp_group is engine.parallel.shard_group)
    out["host_state_ambient_beside_the_engine"] = veomni_state.get_parallel_state() is host
    engine.close()
    out["host_state_kept"] = veomni_state.is_parallel_state_initialized() and veomni_state.get_parallel_state() is host
    veomni_state.clear_parallel_state()
    return out


def main():
    warnings.filterwarnings("ignore")
    model_dir, workdir = sys.argv[1:3]
    dist = init_distributed()
    config = engine_config(model_dir)
    out = {"two_megatron": two_megatron_engines(config, dist, workdir),
           "host": host_parallel_state(config, dist),
           "mix": fsdp_beside_megatron(config, dist),
           "sequential": one_after_another(config, dist),
           "fsdp_veomni_checkpoints": checkpoints_between_fsdp_and_veomni(config, dist, workdir),
           "veomni": two_veomni_engines_and_the_hosts_state(config, dist, workdir)}
    shutdown()
    out["gloo_threads_after_shutdown"] = len(gloo_worker_threads())
    with open(os.path.join(workdir, f"rank{dist.rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
