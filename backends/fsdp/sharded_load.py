"""Build a sharded critic without any rank but the first holding the whole model.

Every rank builds the critic's module tree with its parameters on the meta device and shards it;
each rank then reads from the checkpoint the rows of its own shards (common.engine.pipeline.
build_sharded; checkpoints that cannot be read by slices: rank 0 of the shard group loads the critic
and broadcasts it tensor by tensor). The shard group (the data-parallel ranks, times the Ulysses
degree) may be a sub-world of the host's ranks: nothing here runs on the default group.

The configured transforms (common/engine/transforms.py) rewrite the critic between loading and sharding:
rank 0's loaded copy and every rank's meta tree alike. With one shard rank there is nothing
to shard: the critic is loaded and transformed as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from ...common.engine.mesh import ParallelMesh
from ...common.engine.pipeline import build_sharded, parameters_on_meta
from ...common.engine.transforms import apply_transforms
from ...common.valuehead import LoadReport, load_critic
from ...common.valuehead.config import DECLARED_HEAD, build_critic
from ...common.valuehead.attention import per_tower
from ...common.valuehead.load import plan_load


def _meta_critic(path: str, *, dtype: torch.dtype, attn_implementation: str | None,
                 trust_remote_code: bool, head_prefix: str | None, value_head) -> torch.nn.Module:
    """The critic's module tree (what load_critic builds), its parameters with no storage."""
    plan = plan_load(path, head_prefix=head_prefix, trust_remote_code=trust_remote_code, value_head=value_head)
    with parameters_on_meta():
        return build_critic(plan.config, dtype=dtype, attn_implementation=per_tower(plan.config, attn_implementation))


def load_sharded_critic(
    path: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None,
    load_kwargs: dict,
    transforms: list,
    parallelize: Callable[[torch.nn.Module, DeviceMesh], torch.nn.Module],
    device: torch.device,
    mesh: ParallelMesh,
    cpu_offload: bool = False,
) -> tuple[torch.nn.Module, LoadReport]:
    """(the transformed, parallelised critic on `device`, rank 0's load report) on every rank of the
    mesh's shard group (its data-parallel ranks, times the Ulysses degree). `cpu_offload`: the
    `parallelize` callable applies FSDP2's CPUOffloadPolicy, so a sharded build materialises the
    parameters on the CPU (FSDP2 refuses offloaded shards anywhere else)."""
    fsdp_mesh = mesh.fsdp_device_mesh(device.type)
    if mesh.shard_size == 1:
        model, report = load_critic(path, torch_dtype=dtype, attn_implementation=attn_implementation, **load_kwargs)
        return parallelize(apply_transforms(model.to(device), transforms), fsdp_mesh), report
    model, report = build_sharded(
        path, shard_group=mesh.shard_group, shard_rank=mesh.shard_rank, device=device, dtype=dtype,
        attn_implementation=attn_implementation, load_kwargs=load_kwargs, transforms=transforms,
        # The same tree everywhere (rank 0 too: its loaded copy is dropped once broadcast).
        build_tree=lambda report: _meta_critic(path, dtype=dtype, attn_implementation=report.attn_implementation,
                                               trust_remote_code=load_kwargs.get("trust_remote_code", False),
                                               head_prefix=load_kwargs.get("head_prefix"),
                                               value_head=load_kwargs.get("value_head", DECLARED_HEAD)),
        parallelize=lambda model: parallelize(model, fsdp_mesh), cpu_offload=cpu_offload)
    return model.eval(), report
