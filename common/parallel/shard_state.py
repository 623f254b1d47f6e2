"""A sharded (FSDP2) module's whole state in and out, one tensor at a time, over the engine's own
shard group: never the default group, so an engine on a sub-world of the host's ranks loads and
exports like any other, and no rank but the group's first holds more than its shards plus one
full tensor in flight.

torch's `set_model_state_dict(broadcast_from_rank0=True)` and `get_model_state_dict(full_state_dict=
True, cpu_offload=True)` do the same over global rank 0 (the default group), which a sub-world
engine's group does not contain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .distributed import all_gather_object, sendable_error


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (non-persistent buffers too: rotary frequencies are not
    in a state dict, and FSDP does not shard them)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    return targets


@torch.no_grad()
def broadcast_state_into(model: torch.nn.Module, full_state: dict[str, torch.Tensor] | None, *, group,
                         src: int = 0, device: torch.device | None = None) -> None:
    """Fill `model`'s parameters and buffers (sharded DTensors or plain tensors, materialised) from
    `full_state`, which the rank of index `src` in `group` holds (None elsewhere), tensor by tensor.
    Every name of the module must be in full_state; an extra name in it is an error too.
    `device`: where each full tensor travels (the group's device: CPU-offloaded shards are filled
    from a broadcast on the GPU); None: each target's own device."""
    rank = torch_dist.get_rank(group)
    targets = _targets(model)
    if rank == src:
        missing, extra = sorted(set(targets) - set(full_state)), sorted(set(full_state) - set(targets))
        problem = (missing or extra) and f"the loaded state does not match the module: missing {missing[:5]}, extra {extra[:5]}"
    else:
        problem = None
    global_src = torch_dist.get_global_rank(group, src)
    holder = [problem]
    torch_dist.broadcast_object_list(holder, src=global_src, group=group)
    if holder[0]:
        raise ValueError(holder[0])
    for name, target in targets.items():
        local = target.to_local() if isinstance(target, DTensor) else target
        where = local.device if device is None else device
        full = (full_state[name].to(device=where, dtype=local.dtype) if rank == src
                else torch.empty(target.shape, dtype=local.dtype, device=where))
        torch_dist.broadcast(full, src=global_src, group=group)
        if isinstance(target, DTensor):  # this rank's part of the full tensor: no communication
            full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        local.copy_(full)
        del full


def local_region(target: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of the part of the full tensor this rank holds: a DTensor's local shard, or
    the whole of a plain tensor."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return tuple(shape), tuple(offset)
    return tuple(target.shape), (0,) * target.dim()


@torch.no_grad()
def fill_from_reader(model: torch.nn.Module, read: Callable[[str, tuple[int, int] | None], torch.Tensor],
                     buffers: dict[str, torch.Tensor], *, group) -> None:
    """Fill every parameter and persistent buffer of `model` (sharded DTensors or plain tensors,
    materialised) with the part this rank holds, read by `read(name, (first row, end row))`
    (common.valuehead.sliced.SlicedCritic.read), and the other buffers from `buffers`. No
    communication but the agreement at the end: an error on any rank (a corrupt tensor in its
    rows) is raised on every rank of `group`."""
    error = None
    try:
        for name, target in _targets(model).items():
            local = target.to_local() if isinstance(target, DTensor) else target
            if name in buffers:
                local.copy_(buffers[name])
                continue
            shape, offset = local_region(target)
            part = read(name, (offset[0], offset[0] + shape[0]) if target.dim() else None)
            for dim in range(1, target.dim()):
                part = part.narrow(dim, offset[dim], shape[dim])
            local.copy_(part.reshape(local.shape))
            del part
    except Exception as err:  # noqa: BLE001 - raised on every rank below
        error = sendable_error(err)
    errors = [e for e in all_gather_object(error, group=group) if e is not None]
    if errors:
        raise errors[0]


@torch.no_grad()
def gather_full_state(model: torch.nn.Module, *, group, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The module's full state dict (the names and tensors `model.state_dict()` would have
    unsharded) on the CPU of the rank of index `dst` in `group`, None elsewhere (collective over the
    ranks the tensors are sharded across). Each tensor is gathered, copied to the CPU and dropped
    before the next."""
    main = torch_dist.get_rank(group) == dst
    out: dict[str, torch.Tensor] | None = {} if main else None
    for name, value in get_model_state_dict(model).items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if main:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


def _by_rows(value: DTensor) -> bool:
    """Sharded by rows (dim 0) on one mesh dimension and replicated on the others (FSDP2, HSDP)."""
    shards = [p for p in value.placements if isinstance(p, Shard)]
    return (value.dim() > 0 and len(shards) == 1 and shards[0].dim == 0
            and all(isinstance(p, (Shard, Replicate)) for p in value.placements))


@torch.no_grad()
def iter_state_rows(model: torch.nn.Module, *, group, dst: int = 0) -> Iterator[tuple]:
    """The module's state dict for a writer on the rank of index `dst` in `group` (the ranks the
    state is sharded across), as common.valuehead.safetensors_stream takes it: (name, rows,
    first_row) pieces of each rank's row block of a tensor sharded by rows, sent to `dst` point to
    point and never assembled whole; any other tensor gathered whole and given by row pieces (views
    on the CPU). On the CPU.
    Elsewhere it yields nothing, but every rank of `group` must run it to its end."""
    rank = torch_dist.get_rank(group)
    main = rank == dst
    to = torch_dist.get_global_rank(group, dst)
    for name, value in get_model_state_dict(model).items():
        if not isinstance(value, DTensor) or not _by_rows(value):
            full = value.full_tensor() if isinstance(value, DTensor) else value.detach()
            if main and full.dim():  # by row pieces: views of it on the CPU, copies from a GPU
                for start, stop in row_pieces(full):
                    yield name, full[start:stop].cpu(), start
            elif main:
                yield name, full.cpu()
            del full
            continue
        local = value.to_local()
        shape, offset = local_region(value)
        blocks = all_gather_object((offset[0], shape[0]), group=group)  # where every rank's rows are
        if not main:
            send_rows(local, dst=to, group=group)
            continue
        for source, (first_row, rows) in enumerate(blocks):
            if source == rank:
                pieces = ((start, local[start:stop].detach().to("cpu", copy=True)) for start, stop in row_pieces(local))
            else:
                pieces = recv_rows((rows, *value.shape[1:]), local.dtype, local.device,
                                   src=torch_dist.get_global_rank(group, source), group=group)
            for start, piece in pieces:
                yield name, piece.cpu(), first_row + start
                del piece


PIECE_BYTES = 32 * 2**20
"""Row blocks travel and are written in pieces of at most this many bytes (at least a row): the
writing rank never holds a whole shard of the largest tensor (a large vocabulary's embedding is a
quarter of a 0.5B critic), nor does gloo stage one."""


def row_pieces(tensor_or_shape) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most PIECE_BYTES each (the same on sender and receiver)."""
    shape = tuple(tensor_or_shape.shape) if torch.is_tensor(tensor_or_shape) else tuple(tensor_or_shape[0])
    itemsize = tensor_or_shape.element_size() if torch.is_tensor(tensor_or_shape) else tensor_or_shape[1].itemsize
    rows = shape[0] if shape else 0
    per_row = max(itemsize * (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1), 1)
    step = max(PIECE_BYTES // per_row, 1)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def send_rows(tensor: torch.Tensor, *, dst: int, group) -> None:
    """Send `tensor` to global rank `dst` by row pieces (recv_rows receives them)."""
    for start, stop in row_pieces(tensor):
        torch_dist.send(tensor[start:stop].contiguous(), dst=dst, group=group)


def recv_rows(shape: tuple[int, ...], dtype: torch.dtype, device, *, src: int, group) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, piece) of a tensor of `shape` sent by send_rows from global rank `src`."""
    for start, stop in row_pieces((shape, dtype)):
        piece = torch.empty((stop - start, *shape[1:]), dtype=dtype, device=device)
        torch_dist.recv(piece, src=src, group=group)
        yield start, piece


def recv_into(tensor: torch.Tensor, *, src: int, group) -> torch.Tensor:
    """Receive a tensor sent by send_rows into `tensor` (contiguous, of its shape), piece by piece."""
    for start, stop in row_pieces(tensor):
        torch_dist.recv(tensor[start:stop], src=src, group=group)
    return tensor
