"""torchrun worker (4 processes): a host that gives the critic 2 of its 4 ranks.

argv: model_dir batch_file out_dir. Every rank builds the critic's mesh over ranks {2, 3}
(common.engine.mesh.build_mesh(ranks=...), collective over the world) and the host's own group over
{0, 1}. Ranks 0 and 1 play the actor: collectives of their own, many of them, while ranks 2 and 3
run an fsdp critic, then a VeOmni one, on its sub-world: values, one update, a checkpoint saved and
loaded back, an export. A collective of the critic on the default group would wait for ranks 0 and
1 forever; the world's timeout (120 s) turns that into a failure. Ranks 2 and 3 also record what
megatron says to a sub-world mesh. Then all four ranks compare megatron's parallel_state set from
a mesh (build_mesh(..., backend="megatron")) with megatron-core's own initialize_model_parallel at
several 4-rank layouts. Each rank writes out_dir/rank<r>.pt.
"""

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, process_group_backend, shutdown
from critic_adapters.common.engine import RolloutBatch, build_engine
from critic_adapters.common.engine.mesh import build_mesh
from critic_adapters.common.tests.helpers import FIELDS, installed_backends

CRITIC_RANKS = [2, 3]
SUB_WORLD_BACKENDS = ("fsdp", "veomni")  # those installed run (tools/env-matrix runs this without VeOmni)



def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, grad_clip=1.0),
                        loss=LossConfig(clip_range=None), batching=BatchingConfig(micro_batch_tokens=64))


def critic_run(backend: str, config, dist, mesh, batch_file: str, out_dir: str) -> dict:
    """Values, one update, a checkpoint saved and loaded back, an export, on the sub-world."""
    engine = build_engine(backend, config, dist, mesh=mesh)
    data = torch.load(batch_file)
    mine = torch.arange(engine.dp_rank, data["input_ids"].shape[0], engine.dp_size)
    batch = RolloutBatch(*(data[k][mine] for k in FIELDS))
    out = {"rows": mine, "dp": (engine.dp_rank, engine.dp_size, torch_dist.get_world_size(engine.parallel.world_group))}
    out["values_before"] = engine.compute_values(batch.input_ids, batch.attention_mask)
    out["metrics"] = engine.update(batch)
    out["values_after"] = engine.compute_values(batch.input_ids, batch.attention_mask)
    engine.save_checkpoint(os.path.join(out_dir, "checkpoint"))
    engine.export_hf(os.path.join(out_dir, "export"))
    engine.update(batch)  # moves the weights on; the checkpoint brings them back
    engine.load_checkpoint(os.path.join(out_dir, "checkpoint"))
    out["values_loaded"] = engine.compute_values(batch.input_ids, batch.attention_mask)
    engine.close()
    return out


# megatron layouts at 4 ranks whose parallel_state the mesh must build exactly as megatron-core does.
MEGATRON_LAYOUTS = ({"tensor": 2, "pipeline": 2}, {"tensor": 2, "context": 2}, {"pipeline": 2, "context": 2},
                    {"tensor": 2}, {"pipeline": 2}, {"context": 2}, {}, {"expert": 2}, {"expert": 4},
                    {"tensor": 2, "expert": 2}, {"pipeline": 2, "expert": 2}, {"context": 2, "expert": 2})


def megatron_state_snapshot() -> dict:
    """Every parallel_state global the mesh sets, as rank lists (a group: its ranks)."""
    from megatron.core import parallel_state

    from critic_adapters.backends.megatron import parallelize

    out = {}
    for name in (*parallelize._GROUP_GLOBALS, "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"):
        if not hasattr(parallel_state, name):  # a group of another megatron-core (0.19's GTP_remat ones on 0.16)
            continue
        value = getattr(parallel_state, name)
        out[name] = (sorted(torch_dist.get_process_group_ranks(value)) if isinstance(value, torch_dist.ProcessGroup)
                     else value)
    return out


def megatron_groups_from_the_mesh_vs_megatrons_own(dist) -> dict:
    """{layout: (parallel_state set from build_mesh(..., backend="megatron"), megatron-core's own
    initialize_model_parallel)} on every rank of the world."""
    from megatron.core import parallel_state

    from critic_adapters.backends.megatron import parallelize

    out = {}
    for layout in MEGATRON_LAYOUTS:
        mesh = build_mesh(ParallelConfig(**layout), dist, backend="megatron")
        parallelize._adopt(mesh)
        ours = megatron_state_snapshot()
        parallelize._unadopt()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.get("tensor", 1),
                                                 pipeline_model_parallel_size=layout.get("pipeline", 1),
                                                 context_parallel_size=layout.get("context", 1),
                                                 expert_model_parallel_size=layout.get("expert", 1))
        theirs = megatron_state_snapshot()
        parallel_state.destroy_model_parallel()
        out[str(layout)] = (ours, theirs)
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    model_dir, batch_file, out_dir = sys.argv[1:4]
    torch_dist.init_process_group(process_group_backend(), timeout=datetime.timedelta(seconds=120))
    dist = init_distributed()
    config = engine_config(model_dir)
    critic_mesh = build_mesh(config.parallel, dist, ranks=CRITIC_RANKS)
    actor_group = torch_dist.new_group([0, 1])
    out: dict = {"in_critic": critic_mesh is not None}
    if critic_mesh is None:
        total = torch.zeros(1)
        for _ in range(20):
            step = torch.ones(1)
            torch_dist.all_reduce(step, group=actor_group)
            total += step
        out["actor_sum"] = float(total)
    else:
        try:
            build_engine("megatron", config, dist, mesh=critic_mesh).close()
        except ValueError as err:
            out["refused"] = {"megatron": str(err)}
        for backend in installed_backends(SUB_WORLD_BACKENDS):
            out[backend] = critic_run(backend, config, dist, critic_mesh, batch_file, os.path.join(out_dir, backend))
    out["megatron_groups"] = megatron_groups_from_the_mesh_vs_megatrons_own(dist)
    torch.save(out, os.path.join(out_dir, f"rank{dist.rank}.pt"))
    shutdown()


if __name__ == "__main__":
    main()
