"""What a forward saves for its backward, counted through torch.autograd.graph.saved_tensors_hooks: the
same count on any machine (and on the meta device, where common.engine.memory estimates a step's
activations without computing anything). bench/tensor_bytes.py measures engines with it."""

from __future__ import annotations

import threading

import torch


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
