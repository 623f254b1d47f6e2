"""Build a sharded critic without any rank but the first holding the whole model.

Every rank builds the critic's module tree on the meta device and shards it; only rank 0 of the
shard group (the data-parallel ranks, times the Ulysses degree) reads the checkpoint (load_critic:
any format, the head checks, the load report). Its full state (parameters and buffers, which FSDP
does not shard: rotary frequencies) is then broadcast tensor by tensor over the shard group into
the other ranks' shards (common.parallel.shard_state), so a rank other than 0 holds its shard plus one
tensor in flight — never the whole model, nor the checkpoint's mapped pages. The shard group may be
a sub-world of the host's ranks: nothing here runs on the default group.

The configured transforms (common/engine/transforms.py) rewrite the critic between loading and sharding:
rank 0's loaded copy and every rank's meta tree alike. With one shard rank there is nothing
to shard: the critic is loaded and transformed as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from ...common.parallel.distributed import broadcast_object
from ...common.engine.mesh import ParallelMesh
from ...common.parallel.shard_state import broadcast_state_into
from ...common.valuehead import LoadReport, load_critic
from ...common.valuehead.config import DECLARED_HEAD, critic_class, install_value_head
from ...common.valuehead.load import plan_load


def _meta_critic(path: str, *, dtype: torch.dtype, attn_implementation: str | None,
                 trust_remote_code: bool, head_prefix: str | None, value_head) -> torch.nn.Module:
    """The critic's module tree (what load_critic builds), with no storage."""
    plan = plan_load(path, head_prefix=head_prefix, trust_remote_code=trust_remote_code, value_head=value_head)
    cls = critic_class(plan.config)
    with torch.device("meta"):
        model = cls._from_config(plan.config, attn_implementation=attn_implementation, dtype=dtype)
    return install_value_head(model)


def _fsdp_device_mesh(mesh: ParallelMesh, device_type: str) -> DeviceMesh:
    """The DeviceMesh FSDP shards over: the mesh's shard dimension (dp, times the Ulysses degree)."""
    if mesh.shard_device_mesh is not None:
        return mesh.shard_device_mesh
    return DeviceMesh.from_group(mesh.shard_group, device_type)


def load_sharded_critic(
    path: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None,
    load_kwargs: dict,
    transform: Callable[[torch.nn.Module], torch.nn.Module],
    parallelize: Callable[[torch.nn.Module, DeviceMesh], torch.nn.Module],
    device: torch.device,
    mesh: ParallelMesh,
) -> tuple[torch.nn.Module, LoadReport]:
    """(the transformed, parallelised critic on `device`, rank 0's load report) on every rank of the
    mesh's shard group (its data-parallel ranks, times the Ulysses degree)."""
    dp_group = mesh.shard_group
    rank = mesh.shard_rank
    fsdp_mesh = _fsdp_device_mesh(mesh, device.type)
    if mesh.shard_size == 1:
        model, report = load_critic(path, torch_dtype=dtype, attn_implementation=attn_implementation, **load_kwargs)
        return parallelize(transform(model.to(device)), fsdp_mesh), report

    full_state, report = None, None
    if rank == 0:
        loaded, report = load_critic(path, torch_dtype=dtype, attn_implementation=attn_implementation, **load_kwargs)
        loaded = transform(loaded)
        full_state = dict(loaded.named_parameters(remove_duplicate=False))
        full_state.update(loaded.named_buffers(remove_duplicate=False))  # non-persistent ones too (rotary inv_freq)
        del loaded
    report = broadcast_object(report, group=dp_group)
    # Build the same tree everywhere (rank 0 too: its loaded copy is dropped once broadcast).
    model = transform(_meta_critic(path, dtype=dtype, attn_implementation=report.attn_implementation,
                                   trust_remote_code=load_kwargs.get("trust_remote_code", False),
                                   head_prefix=load_kwargs.get("head_prefix"),
                                   value_head=load_kwargs.get("value_head", DECLARED_HEAD)))
    model = parallelize(model, fsdp_mesh)
    model.to_empty(device=device)
    broadcast_state_into(model, full_state, group=dp_group)
    del full_state
    return model.eval(), report
