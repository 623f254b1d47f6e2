"""The distributed optimizer's checkpoint state, written by the ranks that own it.

megatron-core's DistributedOptimizer keeps, on each data-parallel rank, the fp32 weight and Adam's
moments of one contiguous range of its DDP buffer: for each parameter, a flat range [start, end) of
the parameter's (tensor-parallel) local shard. Its formats in 0.16.1 that reload at another tensor
or pipeline layout either cannot be saved (`fully_sharded_model_space`: "flattened_range is not
supported") or gather a shard's whole state on a data-parallel rank first (`fully_reshardable`:
~12 B per parameter of the shard, on every rank or on rank 0). Here each rank writes what it owns,
in model space: the flat range cut into at most 2 * (dims - 1) + 1 rectangles of the parameter's
global tensor (a partial first row, whole rows, a partial last row), each a view of the optimizer's
own tensors, so a save copies nothing; torch's DCP reads any region back from overlapping
rectangles, so a checkpoint reloads at any layout. The keys and global shapes are
`fully_reshardable`'s (`optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>`), so checkpoints
written with that format load too. Loading hands megatron's own model-space loader
(`load_parameter_state_from_fs_model_space`) each parameter's 1-D range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding, extract_sharded_tensors_and_factories
from megatron.core.optimizer import DistributedOptimizer

from .parallelize import optimizer_parts

# The name megatron's model-space loader dispatches on; our save writes its per-parameter layout.
SHARDING_TYPE = "fully_sharded_model_space"
# The optimizer's state names -> the checkpoint's (fully_reshardable's "param" for the fp32 weight).
_CHECKPOINT_NAME = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, size) in a tensor's coordinates


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The rectangles covering elements [start, end) of a row-major tensor of `shape`, in flat
    order; each is a contiguous run of that order (a part of one row, or whole rows)."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:  # within one row: that row's own rectangles
        return [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start - first * row, end - first * row)]
    boxes = []
    if start % row:
        boxes += [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start % row, row)]
        first += 1
    whole_end = end // row
    if whole_end > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if end % row:
        boxes += [((whole_end, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, end % row)]
    return boxes


@dataclass(frozen=True)
class RowBlock:
    """Rows [first, end) of a parameter's local tensor are rows [global_first, ...) of `template`'s
    global tensor (a plain ShardedTensor: one block; megatron's SwiGLU factory: the gate and the up
    halves, placed apart)."""
    first: int
    end: int
    template: ShardedTensor


def row_blocks(sharded) -> list[RowBlock]:
    """Where each row of a parameter's local tensor sits in the checkpoint's global tensors."""
    if isinstance(sharded, ShardedTensor):  # (megatron-core refuses flattened ones at construction)
        rows = sharded.local_shape[0] if sharded.local_shape else 1
        return [RowBlock(0, rows, sharded)]
    # Build the factory's tensors over a meta tensor of the local shape: each is a view, whose
    # storage offset says which rows it took.
    local = torch.empty(sharded.data.shape, dtype=sharded.data.dtype, device="meta")
    row = math.prod(local.shape[1:]) if local.dim() > 1 else 1
    built = sharded.build_fn(sharded.key, local, sharded.replica_id, None)
    pieces = built.values() if isinstance(built, dict) else built
    blocks = []
    for piece in pieces:
        view = piece.data
        if (not isinstance(piece, ShardedTensor) or not view.is_contiguous() or view.storage_offset() % row
                or tuple(view.shape[1:]) != tuple(local.shape[1:])):
            raise NotImplementedError(f"{sharded.key}: megatron's factory splits it other than into runs of rows")
        first = view.storage_offset() // row
        blocks.append(RowBlock(first, first + view.shape[0], piece))
    return sorted(blocks, key=lambda b: b.first)


def box_tensors(name: str, state: torch.Tensor, start: int, shape: tuple[int, ...], blocks: list[RowBlock]):
    """ShardedTensors for one state tensor of one parameter: `state` holds elements
    [start, start + numel) of the local tensor of `shape`; each rectangle is a view of it."""
    out = []
    for offset, size in flat_boxes(shape, start, start + state.numel()):
        flat = sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(offset)) - start
        row_first, rows = (offset[0], size[0]) if shape else (0, 1)
        for block in blocks:
            lo, hi = max(row_first, block.first), min(row_first + rows, block.end)
            if lo >= hi:
                continue
            part = (lo, *offset[1:]), (hi - lo, *size[1:])
            part_flat = flat + (lo - row_first) * (math.prod(shape[1:]) if shape else 1)
            out.append(_box(name, state, part_flat, part, block, bool(shape)))
    return out


def _box(name: str, state: torch.Tensor, flat: int, part: Box, block: RowBlock, has_rows: bool) -> ShardedTensor:
    (offset, size), t = part, block.template
    p = t.prepend_axis_num
    if len(t.replica_id) != 3:
        raise NotImplementedError(f"{t.key}: replica id {t.replica_id} is not megatron's (pipeline, tensor, data)")
    local_offset = (offset[0] - block.first, *offset[1:]) if has_rows else ()
    global_offset = (*t.global_offset[:p], *(g + o for g, o in zip(t.global_offset[p:], local_offset)))
    # The prepended axes (layer, expert) as axes of size 1: megatron hands a tensor off a regular grid
    # to DCP as it is (CheckpointableShardedTensor), whose chunks have the global tensor's rank.
    local_shape = (*(1,) * p, *size)
    data = state.narrow(0, flat, math.prod(size)).view(local_shape)
    return ShardedTensor(key=f"optimizer.state.{_CHECKPOINT_NAME[name]}.{t.key}", data=data, dtype=data.dtype,
                         local_shape=local_shape, global_shape=t.global_shape, global_offset=global_offset,
                         axis_fragmentations=None,  # rectangles, not a regular grid: DCP checks the cover
                         replica_id=(*t.replica_id[:2], 0))  # one owner among the data-parallel ranks


def _owned_state(part: DistributedOptimizer, by_param: dict) -> dict:
    """param index (megatron's model-space order) -> {state name: [ShardedTensor, ...]}."""
    state, index = {}, 0
    for gbuf_range_maps in part.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    sharded = by_param.get(model_param)
                    if sharded is None:
                        raise ValueError("a parameter the distributed optimizer steps is not in the model's "
                                         "sharded state dict")
                    tensors = part._get_main_param_and_optimizer_states(model_param)
                    tensors["fp32_param"] = tensors.pop("param")
                    blocks = row_blocks(sharded)
                    shape = tuple(sharded.data.shape)
                    state[index] = {name: box_tensors(name, tensors[name].detach().view(-1), ranges["param"].start,
                                                      shape, blocks)
                                    for name in _CHECKPOINT_NAME}
                    index += 1
    return state


def is_distributed(optimizer) -> bool:
    """Whether this module lays out the optimizer's checkpoint state (megatron's DistributedOptimizer,
    alone or the parts of a ChainedOptimizer)."""
    return all(isinstance(part, DistributedOptimizer) for part in optimizer_parts(optimizer))


def sharded_state(optimizer, model_state: dict) -> dict:
    """The distributed optimizer's state for dist_checkpointing (save and load alike): per part, its
    common state (param groups, step) and the rectangles this rank owns. Views, no copies."""
    parts = optimizer_parts(optimizer)
    if len(parts) > 1:
        optimizer._synchronize_steps()
    tensors, _ = extract_sharded_tensors_and_factories(model_state)
    by_param = {sharded.data: sharded for sharded in nested_values(tensors)}  # by the parameter itself
    states = {}
    for i, part in enumerate(parts):
        state = part.state_dict()
        state["param_state"] = _owned_state(part, by_param)
        state["param_state_sharding_type"] = SHARDING_TYPE
        if len(parts) > 1:  # megatron's ChainedOptimizer prefix, so fully_reshardable's checkpoints match
            add_prefix_for_sharding(state, f"chained_{i}.")
        states[i] = state
    return states[0] if len(parts) == 1 else states


def loaded_state(optimizer, loaded: dict) -> dict:
    """dist_checkpointing's result for sharded_state's dict -> what optimizer.load_state_dict takes:
    each parameter's rectangles joined back into its 1-D range."""
    parts = optimizer_parts(optimizer)
    states = [loaded] if len(parts) == 1 else [loaded[i] for i in range(len(parts))]
    for state in states:
        state["param_state"] = {index: {name: torch.cat([t.reshape(-1) for t in pieces])
                                        for name, pieces in tensors.items()}
                                for index, tensors in state["param_state"].items()}
        # The file's common state names the format that wrote it (fully_reshardable, before this
        # module); what was read is in this module's layout whichever wrote it.
        state["param_state_sharding_type"] = SHARDING_TYPE
    return loaded

