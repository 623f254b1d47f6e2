"""Torchrun worker for test_cpu_offload: the same run with and without engine.cpu_offload (values, an
update, values after), what FSDP2 was given (its offload policy, where every parameter and buffer
lives, the devices the build materialised on), and, with 2 or more ranks, where build_sharded
materialises an offloaded tree when the compute device is not the CPU (the meta device stands in
for a GPU). Rank 0 writes {"plain": run, "offload": run, "stand_in": ...} to OUT.

  python -m critic_adapters.backends.fsdp.tests.cpu_offload_worker MODEL_DIR BATCH.pt OUT.pt
"""

import contextlib
import sys

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.backends.fsdp.parallelize import parallelize_critic
from critic_adapters.backends.fsdp.sharded_load import _meta_critic
from critic_adapters.backends.fsdp.tests.worker_common import gather_rows, rank_share
from critic_adapters.common.engine.config import EngineConfig, LossConfig, ModelConfig, OptimConfig
from critic_adapters.common.engine.pipeline import build_sharded
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.valuehead.config import DECLARED_HEAD


@contextlib.contextmanager
def materialisations():
    """The devices every Module.to_empty call inside was asked for."""
    original, seen = torch.nn.Module.to_empty, []

    def to_empty(self, *, device, recurse=True):
        seen.append(torch.device(device).type)
        return original(self, device=device, recurse=recurse)

    torch.nn.Module.to_empty = to_empty
    try:
        yield seen
    finally:
        torch.nn.Module.to_empty = original


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def placement(model: torch.nn.Module) -> dict:
    """FSDP2's offload policies, and the devices of the parameters' local shards and of the buffers."""
    policies = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                policies.add(type(group.offload_policy).__name__)
    return {"policies": sorted(policies), "parameters": sorted({local(p).device.type for p in model.parameters()}),
            "buffers": sorted({b.device.type for b in model.buffers()})}


def one_run(model_dir: str, dist, data, mine, batch, *, cpu_offload: bool):
    """(what the run saw, the engine, still open)."""
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3), loss=LossConfig(clip_range=0.2),
                          cpu_offload=cpu_offload)
    with materialisations() as seen:
        engine = FSDPCriticEngine(config, dist)
    shape = data["input_ids"].shape
    out = {"materialised_on": seen, **placement(engine.model), "world": dist.world_size,
           "values": gather_rows(dist, mine, engine.compute_values(batch.input_ids, batch.attention_mask), shape)}
    metrics = engine.update(batch)
    out["loss"], out["grad_norm"] = metrics["value_loss"], metrics["grad_norm"]
    out["values_after"] = gather_rows(dist, mine, engine.compute_values(batch.input_ids, batch.attention_mask), shape)
    return out, engine


def stand_in_build(model_dir: str, mesh) -> dict:
    """build_sharded of an offloaded critic whose compute device is not the CPU: the meta device
    stands in for the GPU (FSDP2 runs on the CPU mesh; nothing is computed)."""
    fsdp_mesh = mesh.fsdp_device_mesh("cpu")
    model, _ = build_sharded(
        model_dir, shard_group=mesh.shard_group, shard_rank=mesh.shard_rank, device=torch.device("meta"),
        dtype=torch.float32, attn_implementation="sdpa", load_kwargs={}, transforms=[],
        build_tree=lambda report: _meta_critic(model_dir, dtype=torch.float32,
                                               attn_implementation=report.attn_implementation,
                                               trust_remote_code=False, head_prefix=None, value_head=DECLARED_HEAD),
        parallelize=lambda tree: parallelize_critic(tree, fsdp_mesh, mixed_precision="none",
                                                    gradient_checkpointing=False, cpu_offload=True),
        cpu_offload=True)
    return placement(model)


def main():
    model_dir, batch_file, out_file = sys.argv[1:4]
    dist = init_distributed()
    data, mine, batch = rank_share(batch_file, dist)
    results = {}
    for name, cpu_offload in (("plain", False), ("offload", True)):
        results[name], engine = one_run(model_dir, dist, data, mine, batch, cpu_offload=cpu_offload)
        if cpu_offload and dist.world_size > 1:
            results["stand_in"] = stand_in_build(model_dir, engine.parallel)
        engine.close()
    if dist.is_main:
        torch.save(results, out_file)
    shutdown()


if __name__ == "__main__":
    main()
