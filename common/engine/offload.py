"""An engine's state off its compute device between phases (a critic sharing GPUs with its actor).

`offload()` frees the storages of the model's parameters, the gradients and the optimizer state on
the compute device (the storage itself is resized to 0 bytes, not a reference dropped) and keeps
their bytes in host memory (pinned on CUDA); `onload()` puts them back into the same storages. The
tensor objects never change: FSDP2's sharded parameters, DTensors, megatron's grad buffers and the
optimizer's state keep pointing at them, so nothing is re-wrapped and the contents come back bit
for bit. On a CPU machine the same code runs: the engine's storages go to 0 bytes and the host copy
is a separate allocation.

Memory, on CUDA: a storage resized to 0 returns its blocks to torch's caching allocator, which keeps
them reserved for this process; offload then empties that cache (release_cached_device_memory), or
another process (the actor, the rollout engine) would see no free memory (verl does the same after
every offload). Each storage's host buffer is allocated at its first offload and reused by every
later one, until the engine closes (StorageOffload.drop) or the storage is no longer one of the
engine's: pinned memory goes through torch's caching host allocator, which never returns it, so a
fresh buffer per offload would leave up to twice the state pinned for the life of the process. (On
CPU the buffers are a second copy of the state between offloads: CPU offload frees nothing for
another process anyway.)

Nothing onloads silently (two models awake at once is what offloading is for avoiding): a method
that needs what is offloaded raises, naming it. Checkpoints and exports work in either state: they
onload around themselves and offload the same parts again after.

An engine mixes in `Offloadable` and implements `_offload_tensors()` and `_offload_group()`.
"""

from __future__ import annotations

import abc
import contextlib
import functools

import torch

from ..parallel.distributed import one_outcome

# Each storage is counted under the first of these that holds it (a parameter an optimizer lists
# is the model's; a mixed-precision optimizer's fp32 copy is the optimizer's).
KINDS = ("model", "grads", "optimizer")


def release_cached_device_memory() -> None:
    """Return the CUDA blocks torch's caching allocator holds unused to the driver, for other
    processes: called after an offload that freed CUDA storages (a test patches it)."""
    torch.cuda.empty_cache()


def _host_buffer(nbytes: int, *, pinned: bool) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()


class StorageOffload:
    """Host copies of storages whose device memory is freed, by kind, in one reusable host buffer
    per storage."""

    def __init__(self):
        self._held: dict[str, list[tuple[torch.UntypedStorage, torch.UntypedStorage]]] = {}
        self._buffers: dict[int, torch.UntypedStorage] = {}
        """The host buffer of each storage offloaded so far (by its _cdata), kept for the next offload."""

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(self._held)

    @staticmethod
    def storages(tensors_by_kind: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.UntypedStorage]]:
        """Each distinct storage once, under the first kind of KINDS whose tensors use it."""
        seen: set[int] = set()
        out: dict[str, list[torch.UntypedStorage]] = {kind: [] for kind in KINDS}
        for kind in KINDS:
            for tensor in tensors_by_kind.get(kind, ()):
                storage = tensor.untyped_storage()
                if storage._cdata in seen:
                    continue
                seen.add(storage._cdata)
                out[kind].append(storage)
        return out

    def offload(self, tensors_by_kind: dict[str, list[torch.Tensor]], kinds, *, repoint: bool = True) -> None:
        """Free the device storages of `kinds` (those not offloaded yet), keeping host copies.
        `repoint`: a tensor whose storage cannot be resized may be moved onto an owned copy first
        (_adopt_fixed_storages); False makes such a storage an error instead (Offloadable.
        _offload_may_repoint)."""
        wanted = [kind for kind in KINDS if kind in kinds and kind not in self._held]
        if not wanted:
            return
        if repoint:
            _adopt_fixed_storages(tensors_by_kind, wanted)
        else:
            _refuse_fixed_storages(tensors_by_kind, wanted)
        by_kind = self.storages(tensors_by_kind)
        current = {storage._cdata for storages in by_kind.values() for storage in storages}
        self._buffers = {key: host for key, host in self._buffers.items() if key in current}  # storages gone
        freed_cuda = False
        for kind in wanted:
            held = []
            for storage in by_kind[kind]:
                if not storage.nbytes():  # freed already (an FSDP2 all-gather buffer after reshard)
                    continue
                host = self._host_for(storage)
                host.copy_(storage, non_blocking=host.is_pinned())
                held.append((storage, host))
            if any(storage.device.type == "cuda" for storage, _ in held):
                torch.cuda.synchronize()  # the host copies are whole before the device storages go
                freed_cuda = True
            for storage, _ in held:
                storage.resize_(0)
            self._held[kind] = held
        if freed_cuda:
            release_cached_device_memory()

    def _host_for(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """`storage`'s host buffer: the one of its last offload (onload synchronised its copy
        back), or a new one (pinned for a CUDA storage) at its first offload or when its size changed."""
        host = self._buffers.get(storage._cdata)
        if host is None or host.nbytes() != storage.nbytes():
            host = self._buffers[storage._cdata] = _host_buffer(storage.nbytes(),
                                                                pinned=storage.device.type == "cuda")
        return host

    def onload(self, kinds=KINDS) -> frozenset[str]:
        """The offloaded storages of `kinds` back on their device, in place; returns the kinds that came back."""
        back = self.offloaded & frozenset(kinds)
        for kind in back:
            for storage, host in self._held[kind]:
                storage.resize_(host.nbytes())
                storage.copy_(host, non_blocking=host.is_pinned())
            del self._held[kind]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return back

    def host_bytes(self, kind: str) -> int:
        """Bytes of `kind` held in host memory now (0 when it is resident)."""
        return sum(host.nbytes() for _, host in self._held.get(kind, ()))

    def drop(self) -> None:
        """Forget the host copies and buffers (the engine is closed)."""
        self._held.clear()
        self._buffers.clear()

    @staticmethod
    def resident_bytes(tensors_by_kind: dict[str, list[torch.Tensor]]) -> dict[str, int]:
        return {kind: sum(s.nbytes() for s in storages)
                for kind, storages in StorageOffload.storages(tensors_by_kind).items()}


def _adopt_fixed_storages(tensors_by_kind: dict[str, list[torch.Tensor]], kinds) -> int:
    """Move the tensors of `kinds` whose storage cannot be resized (a checkpoint's memory-mapped
    weights, which a one-rank engine computes on directly) onto an owned copy of that storage, every
    tensor that shares it together (tied weights stay tied); returns how many storages moved."""
    fixed: dict[int, list[torch.Tensor]] = {}
    for kind in kinds:
        for tensor in tensors_by_kind.get(kind, ()):
            storage = tensor.untyped_storage()
            if storage.nbytes() and not storage.resizable():
                fixed.setdefault(storage._cdata, []).append(tensor)
    for kind in KINDS:  # the same storage's tensors under the other kinds move with it
        for tensor in tensors_by_kind.get(kind, ()):
            key = tensor.untyped_storage()._cdata
            if key in fixed and all(t is not tensor for t in fixed[key]):
                fixed[key].append(tensor)
    for tensors in fixed.values():
        old = tensors[0].untyped_storage()
        owned = torch.empty(old.nbytes(), dtype=torch.uint8, device=old.device).untyped_storage()
        owned.copy_(old)
        with torch.no_grad():
            for tensor in tensors:
                tensor.set_(owned, tensor.storage_offset(), tensor.size(), tensor.stride())
    return len(fixed)


def _refuse_fixed_storages(tensors_by_kind: dict[str, list[torch.Tensor]], kinds) -> None:
    """RuntimeError when a tensor of `kinds` has a storage that cannot be resized, for an engine whose
    tensors must not be re-pointed: a bug (something aliased a parameter's storage, as numpy does),
    caught before it would silently cut gradients."""
    fixed = [(kind, tuple(tensor.shape)) for kind in kinds for tensor in tensors_by_kind.get(kind, ())
             if tensor.untyped_storage().nbytes() and not tensor.untyped_storage().resizable()]
    if fixed:
        raise RuntimeError(f"offload: {len(fixed)} of the critic's tensors have storages that cannot be resized "
                           f"(e.g. {fixed[0][0]} {list(fixed[0][1])}: something aliased them, as numpy does), and "
                           f"this engine's tensors cannot be re-pointed (its library holds hooks on them)")


def kept_off(engine) -> frozenset[str]:
    """What the engine keeps in host memory between its optimizer steps: the optimizer state with
    engine.optim.offload_state (the step brings it in and sends it back itself)."""
    optim = getattr(getattr(engine, "config", None), "optim", None)
    return frozenset({"optimizer"}) if getattr(optim, "offload_state", False) else frozenset()


def require_resident(engine, kinds, what: str) -> None:
    """ValueError, naming what is offloaded, when any of `kinds` is (never a silent onload); the
    optimizer state engine.optim.offload_state keeps off is the step's own to bring in."""
    missing = sorted((set(kinds) & engine.offloaded) - kept_off(engine))
    if missing:
        raise ValueError(f"{what}: the critic's {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         f"offloaded (engine.offloaded = {sorted(engine.offloaded)}); call engine.onload() first")


def needs_resident(*kinds: str):
    """Method decorator: require_resident(kinds) before the call."""
    def decorate(method):
        @functools.wraps(method)
        def checked(self, *args, **kwargs):
            require_resident(self, kinds, method.__name__)
            return method(self, *args, **kwargs)
        return checked
    return decorate


def resident_during(method):
    """Method decorator: onload what is offloaded for the call, and offload the same parts after (and
    what engine.optim.offload_state keeps off: a checkpoint load may have made the state)."""
    @functools.wraps(method)
    def around(self, *args, **kwargs):
        away = self.offloaded
        parts = away | kept_off(self)
        if not parts:
            return method(self, *args, **kwargs)
        if away:
            self.onload()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.offload(**{kind: kind in parts for kind in KINDS})
    return around


class Offloadable(abc.ABC):
    """offload / onload / offloaded / resident_bytes for an engine (common.engine.CriticEngine)."""

    @abc.abstractmethod
    def _offload_tensors(self) -> dict[str, list[torch.Tensor]]:
        """{kind: the engine's local tensors of that kind on its compute device} (KINDS)."""

    @abc.abstractmethod
    def _offload_group(self):
        """The group every rank of the engine is in (offload and onload agree over it)."""

    _offload_may_repoint: bool = True
    """Whether offload may move a tensor whose storage cannot be resized (a one-rank engine computing
    on a checkpoint's memory-mapped weights) onto an owned copy with `set_()`. False for an engine
    whose library holds hooks on its parameters' gradient accumulators (megatron's DDP): `set_()`
    cuts those hooks, and the gradients would silently stop reaching the optimizer."""

    def _before_offload(self) -> None:
        """Free what need not be kept before the storages are (FSDP2: unsharded parameters)."""

    @property
    def _offload_state(self) -> StorageOffload:
        state = self.__dict__.get("_storage_offload")
        if state is None:
            state = self.__dict__["_storage_offload"] = StorageOffload()
        return state

    @property
    def offloaded(self) -> frozenset[str]:
        """What is off the compute device now: a subset of {"model", "grads", "optimizer"}."""
        return self._offload_state.offloaded

    def offload(self, model: bool = True, optimizer: bool = True, grads: bool = True) -> None:
        """Collective: free these parts' device storages, keeping them in host memory (a part
        offloaded already stays so). model=False (verl's rollout phase) keeps compute_values working."""
        kinds = {kind for kind, on in (("model", model), ("optimizer", optimizer), ("grads", grads)) if on}
        with one_outcome("offloading the critic", group=self._offload_group(),
                         timeout_s=self.config.collective_timeout_s):
            if "model" in kinds and "model" not in self.offloaded:
                self._before_offload()
            self._offload_state.offload(self._offload_tensors(), kinds, repoint=self._offload_may_repoint)

    def onload(self, model: bool = True, optimizer: bool = True, grads: bool = True) -> None:
        """Collective: these parts (every offloaded part by default) back on the compute device, in
        place (a no-op for a resident part). verl's evaluation phase brings back the model only."""
        kinds = {kind for kind, on in (("model", model), ("optimizer", optimizer), ("grads", grads)) if on}
        with one_outcome("onloading the critic", group=self._offload_group(),
                         timeout_s=self.config.collective_timeout_s):
            self._offload_state.onload(kinds)

    def resident_bytes(self) -> dict[str, int]:
        """This rank's bytes of each part on the compute device now (0 for an offloaded part)."""
        return self._offload_state.resident_bytes(self._offload_tensors())

    @contextlib.contextmanager
    def optimizer_state_for_step(self):
        """engine.optim.offload_state: the optimizer state on the compute device for the step inside,
        back in host memory after it (the same bytes: training is bit-identical)."""
        if not kept_off(self):
            yield
            return
        self.onload(model=False, optimizer=True, grads=False)
        try:
            yield
        finally:
            self.offload(model=False, optimizer=True, grads=False)
