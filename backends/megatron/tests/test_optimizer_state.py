"""optimizer_state.py's rectangles, against megatron-core's own sharded tensors: a rank's flat range
of a parameter's local shard, cut into rectangles and placed at their global offsets, puts every
element where megatron's ShardedTensor (or its SwiGLU factory, which places the gate and up halves
apart) puts it (in process); and at data parallel 2, a fresh engine reads back exactly each rank's
optimizer state from our checkpoint and from one in megatron-core's fully_reshardable layout (one
torchrun). Resuming at another tensor degree: test_checkpoints.py."""

import math
import random

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from critic_adapters.backends.megatron.optimizer_state import box_tensors, flat_boxes, row_blocks
from critic_adapters.backends.megatron.tests.launch import run_torchrun
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest


def flat_range(shape, offset, size) -> tuple[int, int]:
    """The flat [start, end) a rectangle covers, asserting it is one contiguous run."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    index = torch.arange(math.prod(shape)).view(shape)
    covered = index[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(-1)
    start = sum(o * st for o, st in zip(offset, strides))
    assert torch.equal(covered, torch.arange(start, start + covered.numel())), (shape, offset, size)
    return start, start + covered.numel()


@pytest.mark.parametrize("shape", [(11,), (5, 6), (3, 4, 5), (2, 3, 2, 4)])
def test_flat_boxes_cover_the_range_in_order(shape):
    numel = math.prod(shape)
    rng = random.Random(0)
    ranges = [(0, numel), (0, 1), (numel - 1, numel), (3, 3)] + [sorted(rng.sample(range(numel + 1), 2))
                                                                  for _ in range(40)]
    for start, end in ranges:
        boxes = flat_boxes(shape, start, end)
        assert len(boxes) <= 2 * (len(shape) - 1) + 1, (shape, start, end, boxes)
        position = start
        for offset, size in boxes:
            lo, hi = flat_range(shape, offset, size)
            assert lo == position and hi > lo, (shape, start, end, boxes)
            position = hi
        assert position == end or (start >= end and not boxes), (shape, start, end, boxes)


def place(sharded_tensors, global_shape) -> torch.Tensor:
    """Scatter ShardedTensors' data into a NaN-filled global tensor (prepended axes included)."""
    out = torch.full(global_shape, float("nan"))
    for t in sharded_tensors:
        p = t.prepend_axis_num  # megatron's: an axis its data does not have; ours: axes of size 1
        index = (*t.global_offset[:p], *(slice(o, o + s) for o, s in zip(t.global_offset[p:], t.local_shape)))
        assert torch.isnan(out[index]).all(), f"{t.key}: two rectangles cover the same elements"
        out[index] = t.data
    return out


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu-factory"])
@pytest.mark.parametrize("local_shape", [(8, 6), (8,)], ids=["matrix", "vector"])
def test_rectangles_land_where_megatron_places_the_shard(swiglu, local_shape):
    tp, tp_rank, layer, layers = 2, 1, 2, 4  # the local shard of tensor rank 1, layer 2 of 4
    local = torch.randn(local_shape)
    sharded = ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc1.weight", local, (0, layer, layers),
                                              (1, tp_rank, tp), replica_id=(0, 0, 1), prepend_axis_num=1)
    if swiglu:
        sharded = apply_swiglu_sharded_factory(sharded, ((0, layer, layers),))
        expected = sharded.build_fn(sharded.key, local, sharded.replica_id, None)
    else:
        expected = [sharded]
    global_shape = (layers, *(s * (tp if i == 0 else 1) for i, s in enumerate(local_shape)))
    reference = place(expected, global_shape)
    blocks = row_blocks(sharded)
    numel = local.numel()
    for start, end in [(0, numel), (3, numel - 2), (7, 8), (numel // 2 - 1, numel // 2 + 1)]:
        boxes = box_tensors("exp_avg", local.reshape(-1)[start:end], start, tuple(local_shape), blocks)
        assert {b.key for b in boxes} == {"optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"}
        assert all(b.replica_id == (0, 0, 0) and b.axis_fragmentations is None and b.prepend_axis_num == 0
                   and b.data.shape == b.local_shape for b in boxes)
        got = place(boxes, global_shape)
        have = ~torch.isnan(got)
        assert int(have.sum()) == end - start, (start, end)
        assert torch.equal(got[have], reference[have]), (start, end)


def test_a_factory_that_does_not_split_by_rows_is_refused():
    local = torch.randn(4, 6)
    sharded = ShardedTensor.from_rank_offsets("w", local, replica_id=(0, 0, 0))
    factory = apply_swiglu_sharded_factory(sharded, ())
    factory.build_fn = lambda key, t, replica_id, flattened_range: [
        ShardedTensor.from_rank_offsets(key, t[:, :3], replica_id=replica_id)]
    with pytest.raises(NotImplementedError, match="other than into runs of rows"):
        row_blocks(factory)


def test_each_rank_reads_back_its_state_from_ours_and_from_fully_reshardable(tmp_path):
    model_dir = save_tiny_causal_lm("qwen2", str(tmp_path / "model"))
    out = run_torchrun(2, "critic_adapters.backends.megatron.tests.optimizer_state_worker", model_dir,
                       str(tmp_path)).stdout
    for rank in range(2):
        for name in ("owned", "fully_reshardable"):
            assert f"rank {rank} {name}: " in out and f"rank {rank} {name}: 0 parameters" not in out, out


if __name__ == "__main__":
    run_pytest(__file__)
