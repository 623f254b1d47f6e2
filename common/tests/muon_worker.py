"""torchrun worker of test_optimizers: Muon on FSDP2 shards, the orthogonalisation shared out among the
ranks against every rank orthogonalising every matrix; writes the whole parameters after 2 steps.

  python -m torch.distributed.run --nproc_per_node 2 -m critic_adapters.common.tests.muon_worker OUT.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from critic_adapters.common.engine import optimizers
from critic_adapters.common.parallel.distributed import init_distributed, shutdown

# Rows that split unevenly (5 over 2 ranks: 3 + 2; 1 row: 1 + 0), wide and tall matrices, more
# matrices than ranks.
SHAPES = [(5, 7), (1, 6), (16, 9), (9, 16), (12, 12), (3, 40)]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(cols, rows, bias=False) for rows, cols in SHAPES))


def run(shared: bool) -> list[torch.Tensor]:
    net = model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    params = list(net.parameters())
    optimizer = optimizers.CriticOptimizer([{"params": params, "kind": "muon"}], lr=0.02, betas=(0.9, 0.95),
                                           eps=1e-8, weight_decay=0.1, state_dtype=torch.float32)
    if not shared:
        optimizer_split = optimizers._row_split
        optimizers._row_split = lambda params: None  # every rank orthogonalises every matrix
    try:
        for step in range(2):
            g = torch.Generator().manual_seed(10 + step)
            for p in params:
                whole = torch.randn(p.shape, generator=g)
                p.grad = torch.distributed.tensor.distribute_tensor(whole, p.device_mesh, p.placements)
            optimizer.step()
    finally:
        if not shared:
            optimizers._row_split = optimizer_split
    return [p.full_tensor() for p in params]


def main(out: str) -> None:
    init_distributed()  # gloo on CPU; shutdown() stops the groups' threads before exit (no abort at exit)
    shared, whole = run(True), run(False)
    owners = optimizers.share_matrices(SHAPES, dist.get_world_size())
    if dist.get_rank() == 0:
        torch.save({"shared": shared, "whole": whole, "owners": owners}, out)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
