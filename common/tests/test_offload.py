"""common.engine.offload on an engine-like set of tensors (a module's parameters, their gradients and
AdamW's state): the host buffers are kept from one offload to the next, and an offload that freed
CUDA storages hands the cached blocks back (the CUDA side is faked where this machine has none)."""

import types

import pytest
import torch

from critic_adapters.common.engine import offload
from critic_adapters.common.tests.helpers import run_pytest


class TinyEngine(offload.Offloadable):
    """What Offloadable needs of an engine: its tensors by kind, a group (none), a timeout."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.model(torch.arange(5)).sum().backward()
        self.optimizer.step()  # AdamW's state exists; the gradients are kept
        self.config = types.SimpleNamespace(collective_timeout_s=60.0)

    def _offload_tensors(self):
        params = list(self.model.parameters())
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"model": params, "grads": [p.grad for p in params], "optimizer": state}

    def _offload_group(self):
        return None


def _snapshot(engine) -> list[torch.Tensor]:
    return [t.clone() for tensors in engine._offload_tensors().values() for t in tensors]


def _storage_count(engine) -> int:
    return len({t.untyped_storage()._cdata for tensors in engine._offload_tensors().values() for t in tensors})


def _host_buffers(engine) -> dict[int, torch.UntypedStorage]:
    """While offloaded: the host storage holding each device storage's bytes, by device storage."""
    return {storage._cdata: host for held in engine._offload_state._held.values() for storage, host in held}


def test_every_offload_of_a_storage_reuses_its_host_buffer_and_close_drops_them():
    """Issue 41, item 7: each offload allocated a new host copy of every storage (pinned on CUDA,
    where torch's caching host allocator never gives it back: up to twice the state pinned for the
    life of the process). One buffer per storage, from its first offload until the engine closes."""
    engine = TinyEngine()
    before = _snapshot(engine)
    engine.offload()
    first = _host_buffers(engine)
    assert len(first) == _storage_count(engine) == 15  # 3 parameters, 3 gradients, AdamW's 3 x 3
    assert all(v == 0 for v in engine.resident_bytes().values())
    first_ptrs = {key: host.data_ptr() for key, host in first.items()}
    engine.onload()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(engine), before))
    engine.optimizer.step()  # the state changes between the cycles: the second copy is not the first's bytes
    changed = _snapshot(engine)
    engine.offload()
    second = _host_buffers(engine)
    assert second.keys() == first.keys()
    assert all(second[key] is first[key] and second[key].data_ptr() == first_ptrs[key] for key in first)
    engine.onload()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(engine), changed))  # bit for bit
    engine._offload_state.drop()  # what an engine's close() does
    assert not engine._offload_state._buffers


@pytest.fixture
def fake_cuda(monkeypatch):
    """Storages registered in the returned set report device cuda:0 (their bytes stay in host
    memory); the CUDA calls offload makes for them are recorded instead of run."""
    fake: set[int] = set()
    calls: list = []
    real_device = torch.UntypedStorage.device
    monkeypatch.setattr(torch.UntypedStorage, "device", property(
        lambda s: torch.device("cuda", 0) if s._cdata in fake else real_device.__get__(s)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(offload, "release_cached_device_memory", lambda: calls.append("empty_cache"))
    make = offload._host_buffer

    def host_buffer(nbytes, *, pinned):  # no pinned memory without CUDA: record that it was asked for
        calls.append(("host_buffer", pinned))
        return make(nbytes, pinned=False)

    monkeypatch.setattr(offload, "_host_buffer", host_buffer)
    return fake, calls


def test_an_offload_that_freed_cuda_storages_empties_the_cache_and_pins_each_buffer_once(fake_cuda):
    """Issue 41, item 7: resize_(0) hands a storage's blocks to torch's caching allocator, which keeps
    them reserved: without torch.cuda.empty_cache() after the offload, another process (the actor,
    the rollout engine) sees no memory freed. Only an offload that freed CUDA storages empties it."""
    fake, calls = fake_cuda
    engine = TinyEngine()
    fake.update(t.untyped_storage()._cdata for tensors in engine._offload_tensors().values() for t in tensors)
    assert {t.untyped_storage().device.type for t in engine.model.parameters()} == {"cuda"}
    before = _snapshot(engine)
    engine.offload()
    storages = _storage_count(engine)
    assert calls.count(("host_buffer", True)) == storages and calls.count(("host_buffer", False)) == 0
    assert calls[-1] == "empty_cache" and calls.count("empty_cache") == 1, calls  # after the last storage went
    assert all(v == 0 for v in engine.resident_bytes().values())
    engine.onload()
    engine.offload(model=False)  # a rollout phase: the optimizer and gradients only
    assert calls.count(("host_buffer", True)) == storages and calls.count("empty_cache") == 2, calls
    engine.onload()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(engine), before))

    calls.clear()
    TinyEngine().offload()  # CPU storages: nothing to give back, nothing pinned
    assert calls == [("host_buffer", False)] * storages


if __name__ == "__main__":
    run_pytest(__file__)
