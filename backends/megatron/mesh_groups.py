"""The process groups megatron-core's parallel_state keeps, as rank lists of the engine's mesh.

megatron-core reads its groups from module globals in megatron.core.parallel_state, which its own
initialize_model_parallel builds over the default group. This engine builds them with its mesh
instead (common.engine.mesh.build_mesh(..., backend="megatron") calls `megatron_groups`) and sets
parallel_state's globals from them (parallelize.adopt_mesh): the same groups megatron would make
(its rank order tp-cp-ep-dp-pp is the mesh's pipeline, data, context, tensor, outermost first;
checked against initialize_model_parallel in tests/test_sub_world.py), over the ranks the mesh
has. The expert groups follow megatron's expert grid (tensor-expert-data-pipeline, innermost
first, with the experts' tensor parallelism that of the dense layers): within a pipeline stage the
data x context x tensor ranks are regrouped as expert-data x expert x tensor. There is one
distributed-optimizer instance.

Imports no megatron: the registry resolves this module while building a mesh.
"""

from __future__ import annotations

from ...common.engine.mesh import CONTEXT, DATA, PIPELINE, TENSOR, ranks_along, ranks_along_axes


def expert_groups(layout, expert: int) -> dict[str, tuple[list[list[int]], str | None]]:
    """The expert-parallel groups: each pipeline stage's ranks (data, context, tensor; tensor
    innermost) as a grid (expert-data, expert, tensor)."""
    pipeline, tensor = layout.shape[0], layout.shape[-1]
    grid = layout.reshape(pipeline, -1, expert, tensor)  # (pipeline, expert-data, expert, tensor)
    return {
        "expert": (ranks_along_axes(grid, 2), None),
        "expert_tensor": (ranks_along_axes(grid, 2, 3), None),
        "expert_tensor_pipeline": (ranks_along_axes(grid, 0, 2, 3), None),
        "expert_data": (ranks_along_axes(grid, 1), None),
        "expert_data_gloo": (ranks_along_axes(grid, 1), "gloo"),
    }


def megatron_groups(layout, parallel) -> dict[str, tuple[list[list[int]], str | None]]:
    """{name: (rank lists, backend)} of the groups parallel_state keeps beyond the mesh's own
    dimensions (the mesh's tensor / pipeline / context / data groups are reused where a list is
    one of them). `layout`: the engine's global ranks over common.engine.mesh.DIMS; `parallel`:
    engine.parallel (its expert degree)."""
    pipelines = ranks_along(layout, PIPELINE)
    return {
        **expert_groups(layout, parallel.expert),
        # One per dimension, degree-1 dimensions included (megatron needs a group of one there).
        "tensor": (ranks_along(layout, TENSOR), None),
        "pipeline": (pipelines, None),
        "context": (ranks_along(layout, CONTEXT), None),
        "data": (ranks_along(layout, DATA), None),
        "model": (ranks_along(layout, PIPELINE, TENSOR), None),
        "data_context": (ranks_along(layout, DATA, CONTEXT), None),
        "tensor_data": (ranks_along(layout, DATA, TENSOR), None),
        "tensor_context": (ranks_along(layout, CONTEXT, TENSOR), None),
        "tensor_data_context": (ranks_along(layout, DATA, CONTEXT, TENSOR), None),
        # First and last pipeline stage (tied embeddings), first stage (position embeddings).
        "embedding": ([[p[0], p[-1]] if len(p) > 1 else [p[0]] for p in pipelines], None),
        "position_embedding": ([[p[0]] for p in pipelines], None),
        # megatron keeps gloo copies of the data-parallel groups (its distributed optimizer's
        # checkpoints); on a gloo world they are the groups above.
        "data_gloo": (ranks_along(layout, DATA), "gloo"),
        "data_context_gloo": (ranks_along(layout, DATA, CONTEXT), "gloo"),
    }
