"""What torch itself holds, in bytes: figures that are the same on any machine with the same device
type and library versions, beside the resident-set figures, which move with the allocator, glibc's
thresholds and the kernel (the same commit's long-context memory ratio read 0.52 on one 2-core
machine and 0.73 on another).

  state_bytes(engine)            this rank's bytes of parameters, gradients and optimizer state
  SavedForBackward(model)        the most bytes a window's forwards had saved for the backward at once
  DevicePeak()                   torch.cuda.max_memory_allocated over a window (None off CUDA)
  over_ranks(figures, group)     a rank's figures -> the largest rank's and the sum over ranks
"""

from __future__ import annotations

import torch

from critic_adapters.common.engine.saved_bytes import SavedForBackward  # noqa: F401 - part of this module's API

STATE_KINDS = {"parameters": "model", "gradients": "grads", "optimizer": "optimizer"}  # -> _offload_tensors()


def _union_bytes(spans: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor covers, [start, end)."""
    start = tensor.storage_offset() * tensor.element_size()
    if tensor.numel() == 0:
        return start, start
    elements = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + elements * tensor.element_size()


def state_bytes(engine) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, from the engine's own list of
    its tensors (`_offload_tensors()`, every backend): FSDP2's local shards, megatron's parameters
    and DDP's gradient buffer views, the optimizer's state (and megatron's fp32 main parameters when
    they are not the model's). Each byte counts once, under the first kind that holds it (a
    parameter megatron's optimizer lists is a parameter; a shard viewing DDP's buffer is the
    buffer's bytes). Counted from the tensors' sizes, not their storages': FSDP2's shard padding
    and a buffer's alignment slack are left out, and a part offloaded to host memory (offload_state,
    engine.offload()) still counts, wherever it lives now (engine.resident_bytes() says where)."""
    tensors = engine._offload_tensors()
    covered: dict[int, list[tuple[int, int]]] = {}  # storage -> the spans counted so far
    out = {}
    for name, kind in STATE_KINDS.items():
        mine: dict[int, list[tuple[int, int]]] = {}
        for tensor in tensors.get(kind, ()):
            mine.setdefault(tensor.untyped_storage()._cdata, []).append(_span(tensor))
        out[name] = 0
        for key, spans in mine.items():
            before = covered.get(key, [])
            covered[key] = before + spans
            out[name] += _union_bytes(covered[key]) - _union_bytes(before)
    return out


class DevicePeak:
    """`with DevicePeak() as device:` device.peak = torch.cuda.max_memory_allocated() during the
    window and device.added = that minus what was allocated at its start; both None off CUDA."""

    peak: int | None = None
    added: int | None = None

    def __enter__(self) -> "DevicePeak":
        self._on = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._on:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        if self._on:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            self.added = self.peak - self._base


def over_ranks(figures: dict[str, int | None], group) -> dict[str, dict[str, int | None]]:
    """{"max_per_rank": {...}, "all_ranks": {...}} of a rank's figures (None stays None: off CUDA)."""
    from critic_adapters.common.parallel.distributed import all_reduce

    names = [name for name, value in figures.items() if value is not None]
    values = [float(figures[name]) for name in names]
    largest = dict(zip(names, all_reduce(values, op="max", group=group)))
    summed = dict(zip(names, all_reduce(values, group=group)))
    return {"max_per_rank": {name: None if name not in largest else int(largest[name]) for name in figures},
            "all_ranks": {name: None if name not in summed else int(summed[name]) for name in figures}}
