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

import threading

import torch

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


class _Saved:
    """What the pack hook returns: holds the saved tensor for the graph; dropping it (the graph frees
    its saved tensors once their backward ran) releases the storage's count."""

    __slots__ = ("tensor", "key", "window")

    def __init__(self, tensor: torch.Tensor, key: int, window: "SavedForBackward"):
        self.tensor, self.key, self.window = tensor, key, window

    def __del__(self):
        self.window._release(self.key)


class SavedForBackward:
    """`with SavedForBackward(model) as saved:` around an update: saved.peak, the most bytes the
    forward passes inside had saved for their backward at once (through
    torch.autograd.graph.saved_tensors_hooks).

    A storage counts once however many tensors (views, the same tensor in several ops) are saved
    from it, with its whole size, until the last of them is freed (the graph drops its saved tensors
    once their backward ran). The model's parameters are left out (they are not activations): every
    storage a module's own parameters use at its forward, which includes FSDP2's gathered
    parameters and megatron's contiguous parameter buffer. Checkpointed layers count their inputs,
    which the checkpoint saves, not what their recomputation saves during the backward: torch's
    non-reentrant checkpoint (fsdp, VeOmni) keeps those to itself, and megatron's reentrant one,
    whose recomputation saves through these hooks, is skipped for the same figure on every backend."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.peak = self.live = 0
        self._counts: dict[int, list[int]] = {}  # storage key -> [saved tensors holding it, its bytes]
        self._params: set[int] = set()
        self._lock = threading.Lock()  # on CUDA the backward runs on autograd's device threads

    def _record_params(self, module, args) -> None:
        self._params.update(p.untyped_storage()._cdata for p in module.parameters(recurse=False))

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata  # unique while the storage lives, and _Saved keeps it alive
        # A backward's recomputation (the graph task id is -1 outside a backward, as torch's
        # checkpoint reads it) or a parameter: not counted.
        if key in self._params or torch._C._current_graph_task_id() != -1:
            return tensor
        with self._lock:
            entry = self._counts.get(key)
            if entry is None:
                entry = self._counts[key] = [0, storage.nbytes()]
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._counts[key]
            entry[0] -= 1
            if not entry[0]:
                self.live -= entry[1]
                del self._counts[key]

    def __enter__(self) -> "SavedForBackward":
        self._params = {p.untyped_storage()._cdata for p in self.model.parameters()}
        self._handles = [m.register_forward_pre_hook(self._record_params) for m in self.model.modules()]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()


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
