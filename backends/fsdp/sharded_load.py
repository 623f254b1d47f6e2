"""Build a sharded critic without any rank but the first holding the whole model.

Every rank builds the critic's module tree on the meta device and shards it; only data-parallel
rank 0 reads the checkpoint (load_critic: any format, the head checks, the load report). Its full
state is then broadcast tensor by tensor into the other ranks' shards
(`set_model_state_dict(broadcast_from_rank0=True)`), so a rank other than 0 holds its shard plus
one tensor in flight — never the whole model, nor the checkpoint's mapped pages. Buffers, which
FSDP does not shard (rotary frequencies), follow from rank 0 the same way.

With one data-parallel rank there is nothing to shard: the critic is loaded as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from ...common.distributed import broadcast_object
from ...common.valuehead import LoadReport, load_critic
from ...common.valuehead.config import critic_class
from ...common.valuehead.load import plan_load


def _meta_critic(path: str, *, dtype: torch.dtype, attn_implementation: str | None,
                 trust_remote_code: bool, head_prefix: str | None) -> torch.nn.Module:
    """The critic's module tree (what load_critic builds), with no storage."""
    plan = plan_load(path, head_prefix=head_prefix, trust_remote_code=trust_remote_code)
    cls = critic_class(plan.config)
    with torch.device("meta"):
        model = cls._from_config(plan.config, attn_implementation=attn_implementation, dtype=dtype)
    return model


def load_sharded_critic(
    path: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None,
    load_kwargs: dict,
    parallelize: Callable[[torch.nn.Module, DeviceMesh], torch.nn.Module],
    device: torch.device,
    dp_group,
) -> tuple[torch.nn.Module, LoadReport]:
    """(the parallelised critic on `device`, rank 0's load report) on every rank of `dp_group`."""
    rank = torch_dist.get_rank(dp_group)
    mesh = DeviceMesh.from_group(dp_group, device.type)
    if torch_dist.get_world_size(dp_group) == 1:
        model, report = load_critic(path, torch_dtype=dtype, attn_implementation=attn_implementation, **load_kwargs)
        return parallelize(model.to(device), mesh), report

    # set_model_state_dict broadcasts over the default group: shard over all ranks or none.
    assert torch_dist.get_world_size(dp_group) == torch_dist.get_world_size(), "sharded load needs dp = world"
    full_state, buffers, report = {}, {}, None
    if rank == 0:
        loaded, report = load_critic(path, torch_dtype=dtype, attn_implementation=attn_implementation, **load_kwargs)
        full_state = loaded.state_dict()
        buffers = dict(loaded.named_buffers())  # non-persistent ones (rotary inv_freq) are not in state_dict
        del loaded
    report = broadcast_object(report, group=dp_group)
    # Build the same tree everywhere (rank 0 too: its loaded copy is dropped once broadcast).
    model = _meta_critic(path, dtype=dtype, attn_implementation=report.attn_implementation,
                         trust_remote_code=load_kwargs.get("trust_remote_code", False),
                         head_prefix=load_kwargs.get("head_prefix"))
    model = parallelize(model, mesh)
    model.to_empty(device=device)
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    src = torch_dist.get_global_rank(dp_group, 0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if rank == 0:
                buffer.copy_(buffers[name].to(device))
            torch_dist.broadcast(buffer, src=src, group=dp_group)
    del full_state, buffers
    return model.eval(), report
