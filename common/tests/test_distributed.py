"""Process-group setup for GPUs without a GPU: the group carries gloo for the CPU tensors our
collectives use and nccl for the model's, and every collective runs on the group it is given
(never the default group by omission).

An NCCL-only group once received CPU tensors from all_reduce, so the first collective on 2+ GPUs
failed. A GPU machine is simulated by patching torch.cuda and torch.distributed.
"""

import pytest
import torch
import torch.distributed as dist

from critic_adapters.common.parallel import distributed
from critic_adapters.common.tests.helpers import run_pytest


@pytest.fixture
def fake_gpu_world(monkeypatch):
    """A 2-rank CUDA machine as far as common.parallel.distributed can tell; records the calls it makes."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kw: calls.append(("all_reduce", tensor, kw)))
    monkeypatch.setattr(dist, "broadcast_object_list",
                        lambda objects, **kw: calls.append(("broadcast_object_list", objects, kw)))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    return calls


def test_a_gpu_group_has_gloo_for_cpu_tensors(fake_gpu_world):
    context = distributed.init_distributed()
    assert fake_gpu_world[0][:2] == ("init", "cpu:gloo,cuda:nccl")
    assert context.device == torch.device("cuda", 1) and context.world_size == 2


def test_a_hosts_group_without_a_cpu_backend_is_refused_naming_the_fix(fake_gpu_world, monkeypatch):
    """Issue 41, item 11: a host that started the default group with init_process_group("nccl") has no
    backend for CPU tensors, nor has any group made from it: the float64 all_reduce, the barrier and
    megatron's pipeline broadcast of the values would fail at the first step ("No backend type
    associated with device type cpu"). init_distributed refuses such a group up front, naming the
    fix; a group with gloo for CPU tensors is joined as it is."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")  # init_process_group("nccl")
    with pytest.raises(ValueError, match=r"no backend for CPU tensors \(backend 'cuda:nccl'\).*"
                                         r"init_process_group\(\"cpu:gloo,cuda:nccl\"\)"):
        distributed.init_distributed()
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert distributed.init_distributed().device == torch.device("cuda", 1)
    assert fake_gpu_world == []  # joined, never started


# A default group whose only backend serves CUDA tensors, as init_process_group("nccl") makes one:
# gloo registered under another name for the cuda device alone (this machine has no NCCL).
CUDA_ONLY_GROUP = """
import torch
import torch.distributed as td
from critic_adapters.common.parallel.distributed import init_distributed
td.Backend.register_backend("cuda_only", lambda store, rank, size, timeout: td.ProcessGroupGloo(store, rank, size, timeout),
                            devices=["cuda"])
td.init_process_group("cuda_only", store=td.HashStore(), rank=0, world_size=1)
try:
    td.all_reduce(torch.zeros(1), group=td.new_group([0]))  # what the critic's collectives would meet
except RuntimeError as err:
    print("cpu all_reduce:", err)
try:
    init_distributed()
    print("joined")
except ValueError as err:
    print("refused:", err)
td.destroy_process_group()
"""


def test_a_real_group_without_a_cpu_backend_fails_cpu_collectives_and_is_refused():
    """Issue 41, item 11, on a real process group: CPU collectives on it (and on a group made from it)
    fail, and init_distributed refuses to join it."""
    import subprocess
    import sys

    from critic_adapters.common.tests.torchrun import worker_env

    result = subprocess.run([sys.executable, "-c", CUDA_ONLY_GROUP], env=worker_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "cpu all_reduce: No backend type associated with device type cpu", result.stdout
    assert lines[1].startswith("refused: the default process group has no backend for CPU tensors (backend "
                               "'cuda:cuda_only')") and "init_process_group(" in lines[1], result.stdout


def test_collectives_send_cpu_tensors_to_the_group_they_are_given(fake_gpu_world, monkeypatch):
    distributed.init_distributed()
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank + 2)
    engine_group = object()  # an engine's group: a sub-world of the host's ranks
    distributed.all_reduce([1.0, 2.0], op="max", group=engine_group)
    distributed.barrier(engine_group)
    distributed.broadcast_object("x", group=engine_group)
    collectives = fake_gpu_world[1:]
    assert [c[0] for c in collectives] == ["all_reduce", "all_reduce", "broadcast_object_list"]
    for name, payload, kwargs in collectives:
        assert kwargs.get("group") is engine_group, f"{name} ran on another group"
        if name == "all_reduce":
            assert payload.device.type == "cpu"
    assert collectives[-1][2]["src"] == 2  # the group's rank 0, as a global rank


def test_a_collective_without_a_group_is_refused_where_others_would_wait(fake_gpu_world):
    """The default group is every rank of the host: an engine's collective there would wait for
    ranks that are not the engine's. Without a process group (a Ray driver) None is fine."""
    distributed.init_distributed()
    for collective in (lambda: distributed.all_reduce([1.0], group=None), lambda: distributed.barrier(None),
                       lambda: distributed.broadcast_object("x", group=None)):
        with pytest.raises(RuntimeError, match="without a process group in a world of 2: pass the engine's"):
            collective()
    assert fake_gpu_world[1:] == []


def test_without_a_process_group_collectives_are_this_process_alone(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert distributed.all_reduce([3.0], group=None) == [3.0]
    assert distributed.broadcast_object("x", group=None) == "x"
    assert distributed.all_gather_object("x", group=None) == ["x"]
    assert distributed.world_group() is None


def test_cpu_only_machines_use_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.process_group_backend() == "gloo"


def test_a_rank_that_fails_alone_makes_every_rank_raise_its_message_within_the_timeout(tmp_path):
    # Between collectives at once; before a collective the other rank waits in, at the group's timeout.
    import json

    from critic_adapters.common.tests.outcome_worker import TIMEOUT_S
    from critic_adapters.common.tests.torchrun import run_torchrun

    run_torchrun(2, "critic_adapters.common.tests.outcome_worker", str(tmp_path), timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for step, longest in (("between", TIMEOUT_S / 2), ("inside", 3 * TIMEOUT_S)):
        own, other = ranks[1][step]["raised"], ranks[0][step]["raised"]
        assert own == {"type": "ValueError", "message": f"rank 1's own problem in step {step}"}, own
        assert other == {"type": "ValueError",
                         "message": f"step {step} failed on rank 1: rank 1's own problem in step {step}"}, other
        assert all(r[step]["seconds"] < longest for r in ranks), (step, ranks)
    assert ranks[0]["inside"]["seconds"] >= TIMEOUT_S * 0.9  # it did wait in the collective, until the timeout



FAILED_WHILE_HOLDING_A_GROUP = """
import warnings
import torch.distributed as td
from critic_adapters.common.parallel.distributed import init_distributed
from critic_adapters.common.job.launcher import fail
dist = init_distributed()
def build():
    group = td.new_group([0])  # what a half-built engine's mesh holds when it is refused
    raise ValueError("refused while building")
try:
    build()
except ValueError as err:
    warnings.simplefilter("error")  # the gloo-thread RuntimeWarning of shutdown() becomes an error
    raise SystemExit(fail(err, dist))
"""


def test_a_refused_launch_closes_what_it_opened_with_no_warning():
    # Issue 27, 4.10: the error's traceback kept a process group alive through shutdown().
    import subprocess
    import sys

    from critic_adapters.common.tests.torchrun import worker_env

    result = subprocess.run([sys.executable, "-c", FAILED_WHILE_HOLDING_A_GROUP], env=worker_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == "error: refused while building", result.stderr

if __name__ == "__main__":
    run_pytest(__file__)
