"""Process-group setup and the few collectives the engines and trainer need, passed around explicitly.

Works the same under torchrun (env:// rendezvous) and in a plain single process (a world of one).
On GPU the default group has two backends, `cpu:gloo,cuda:nccl` (as torchtitan and verl set it up):
the few host-side numbers and objects exchanged here stay CPU tensors and go through gloo, while the
model's collectives run on NCCL. Every group an engine makes inherits the default group's backends,
so a host's default group without a CPU backend (`init_process_group("nccl")`) is refused by
init_distributed, naming the fix. Every collective names its group explicitly.
"""

from __future__ import annotations

import pickle

import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import os
import socket
import time
import warnings

import torch
import torch.distributed as dist

from . import launch_log


@dataclasses.dataclass(frozen=True, slots=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_backend() -> str:
    """gloo on CPU; with CUDA, gloo for CPU tensors and nccl for CUDA tensors in one group."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _require_cpu_backend() -> None:
    """ValueError naming the fix when the default group (a host's) has no backend for CPU tensors.
    The CPU collectives here (float64 all_reduce, barrier) and megatron's pipeline broadcast of the
    values run on the engine's groups, which new_group and DeviceMesh make with the default group's
    backends: on an NCCL-only group each raises "No backend type associated with device type cpu"."""
    config = dist.get_backend_config()  # "cpu:gloo,cuda:nccl"; "cuda:nccl" after init_process_group("nccl")
    if "cpu" not in {pair.split(":")[0] for pair in config.split(",")}:
        raise ValueError(f"the default process group has no backend for CPU tensors (backend {config!r}), and the "
                         f"critic exchanges host-side numbers as CPU tensors on every group it makes: start it with "
                         f"torch.distributed.init_process_group(\"{process_group_backend()}\"), or let "
                         f"init_distributed() start it")


@contextlib.contextmanager
def groups_time_out_after(seconds: float | None):
    """Process groups created inside take `seconds` as their timeout where the creator passes none
    (torch's DeviceMesh, megatron's and VeOmni's own groups): a collective some rank never joins
    then raises on the ranks waiting in it instead of blocking them for torch's 30 minutes."""
    if seconds is None:
        yield
        return
    from torch.distributed import distributed_c10d

    saved = distributed_c10d.default_pg_timeout
    distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    try:
        yield
    finally:
        distributed_c10d.default_pg_timeout = saved


def init_distributed(timeout_s: float | None = None) -> DistContext:
    """Join (or create) the default process group (see process_group_backend). `timeout_s`: how
    long a collective waits for a rank that never joins it (engine.collective_timeout_s; None:
    torch's default) when this call creates the group. A group the host started must have a
    backend for CPU tensors (ValueError otherwise, naming the fix)."""
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        _require_cpu_backend()
    else:
        # torch.distributed.nn.functional binds `group=group.WORLD` as a default argument when it
        # is imported: imported once the group exists (megatron and others do), it would hold the
        # default group for the life of the process (see _release_destroyed_groups). Imported now,
        # its defaults are None, "the default group at call time".
        importlib.import_module("torch.distributed.nn.functional")
        if "RANK" not in os.environ:  # not under torchrun: a world of one, with an in-process store
            # (no port to bind: a free port picked here can be taken before the bind). The env://
            # variables are still set: libraries read them (VeOmni takes its rank from RANK and
            # LOCAL_RANK, with defaults that are not 0).
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            dist.init_process_group(process_group_backend(), store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(process_group_backend(), timeout=timeout)
    launch_log.ready("world")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _group(group):
    """`group`, checked: None is allowed only where there is no one else (no process group, or a
    world of one): a collective that forgot its group would otherwise run on the default group,
    which is every rank of the host, not the engine's."""
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("a collective without a process group in a world of "
                           f"{dist.get_world_size()}: pass the engine's (its mesh's world_group or dp_group)")
    return group


def _active(group) -> bool:
    return _group(group) is not None and dist.get_world_size(group) > 1


def all_reduce(values: list[float], op: str = "sum", *, group) -> list[float]:
    """Sum or max of a few numbers across the ranks of `group`, as a float64 CPU tensor (token
    counts stay exact; on GPU it goes through the group's gloo backend)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if _active(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def broadcast_object(obj, src: int = 0, *, group):
    """`obj` of the rank whose index within `group` is `src`, on every rank of the group."""
    if not _active(group):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, src), group=group)
    return holder[0]


def all_gather_object(obj, *, group) -> list:
    """Every rank's `obj`, in rank order."""
    if not _active(group):
        return [obj]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def group_rank(group) -> int:
    """This rank's index within `group` (0 in a world of one)."""
    return dist.get_rank(group) if _active(group) else 0


def gather_object(obj, dst: int = 0, *, group) -> list | None:
    """Every rank's `obj`, in rank order, on the rank whose index within `group` is `dst`; None elsewhere."""
    if not _active(group):
        return [obj]
    main = dist.get_rank(group) == dst
    gathered = [None] * dist.get_world_size(group) if main else None
    dist.gather_object(obj, gathered, dst=dist.get_global_rank(group, dst), group=group)
    return gathered


def sendable_error(err: BaseException) -> BaseException:
    """`err` itself when it pickles (to raise it on other ranks), else a RuntimeError naming it."""
    try:
        pickle.dumps(err)
    except Exception:  # noqa: BLE001 - any pickling failure means "send a description instead"
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


def barrier(group) -> None:
    """Wait for every rank of `group`; a CPU all-reduce, so it needs no device (gloo on any machine)."""
    if _active(group):
        dist.all_reduce(torch.zeros(1), group=group)


class FailedOnAnotherRank(RuntimeError):
    """A step every rank runs failed on another rank (the message is that rank's)."""


_OUTCOMES: dict[tuple[int, ...], int] = {}  # per group (its global ranks): how many outcomes it agreed on


def _failure_kind(err: BaseException) -> str:
    if isinstance(err, ValueError):
        return "ValueError"
    if isinstance(err, OSError):
        return "OSError"
    text = str(err).lower()
    # What a rank left waiting in a collective sees when its peer failed: an effect, not the cause.
    if isinstance(err, (RuntimeError, dist.DistError)) and any(
            mark in text for mark in ("timed out", "timeout", "connection closed", "connection reset")):
        return "collective"
    return type(err).__name__


def agree_on_failure(error: BaseException | None, what: str, *, group, timeout_s: float, lost=None) -> None:
    """Every rank of `group` calls this after `what` with its own error (None: it succeeded); if
    any rank failed, every rank raises: the rank whose error caused it re-raises its own, the others
    an error of the same kind (ValueError, OSError, else FailedOnAnotherRank) with that rank's
    message. The outcomes travel through the process group's store, not a collective: a rank that
    failed before a collective its peers are in must not meet them in the wrong one (they leave it
    at the group's timeout, then learn here why). A rank that does not report within twice
    `timeout_s` (the collective timeout it may first wait out, then as long again) is named in a
    RuntimeError. `lost` (optional: () -> a reason or None) is asked while waiting: a rank it says is
    gone (a process that exited) ends the wait at once with a RuntimeError giving its reason, rather
    than after the timeout."""
    if not _active(group):
        if error is not None:
            raise error
        return
    from torch.distributed import distributed_c10d

    ranks = tuple(dist.get_process_group_ranks(group))
    count = _OUTCOMES[ranks] = _OUTCOMES.get(ranks, 0) + 1
    prefix = f"critic_adapters/outcome/{'-'.join(map(str, ranks))}/{count}/"
    store, me = distributed_c10d._get_default_store(), dist.get_rank()
    kind = None if error is None else _failure_kind(error)
    mine = None if error is None else {
        "kind": kind, "message": str(error) if kind in ("ValueError", "OSError") else f"{type(error).__name__}: {error}"}
    store.set(prefix + str(me), json.dumps(mine))
    try:
        _wait_for_outcomes(store, [prefix + str(r) for r in ranks], 2 * timeout_s, lost)
    except _RankGone as gone:
        raise RuntimeError(f"{what}: {gone}") from error
    except Exception as waited:  # noqa: BLE001 - the store's timeout error has no stable type
        missing = [r for r in ranks if not store.check([prefix + str(r)])]
        raise RuntimeError(f"{what}: rank(s) {missing} did not finish it within {2 * timeout_s:g} s "
                           f"(twice engine.collective_timeout_s); their logs say why") from (error or waited)
    failed = {r: json.loads(store.get(prefix + str(r))) for r in ranks}
    failed = {r: outcome for r, outcome in failed.items() if outcome is not None}
    if not failed:
        return
    cause = min(failed, key=lambda r: (failed[r]["kind"] == "collective", r))
    if cause == me:
        raise error
    kind, message = failed[cause]["kind"], failed[cause]["message"]
    text = f"{what} failed on rank {cause}: {message}"
    raise (ValueError(text) if kind == "ValueError" else OSError(text) if kind == "OSError"
           else FailedOnAnotherRank(text)) from error


class _RankGone(Exception):
    """agree_on_failure's `lost` named a rank that is gone."""


def _wait_for_outcomes(store, keys: list[str], timeout_s: float, lost) -> None:
    if lost is None:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return
    # Polled rather than waited on: a store wait cannot be interrupted when a rank is found gone.
    deadline, pause = time.monotonic() + timeout_s, 0.002
    while not store.check(keys):
        reason = lost()
        if reason:
            raise _RankGone(reason)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reported within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


@contextlib.contextmanager
def one_outcome(what: str, *, group, timeout_s: float, lost=None):
    """The block runs on every rank of `group`, and fails on every rank or on none (agree_on_failure;
    `lost` as there). Ctrl-C and exit pass through: every rank got the signal."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # noqa: BLE001 - reported to every rank, then re-raised here
        agree_on_failure(err, what, group=group, timeout_s=timeout_s, lost=lost)
        raise
    agree_on_failure(None, what, group=group, timeout_s=timeout_s, lost=lost)


def world_group():
    """The default group (every process of this job), or None without one: for what the job itself
    runs across all its processes (the launcher's trainer, shutdown), never inside an engine."""
    return dist.group.WORLD if dist.is_initialized() else None


def gloo_worker_threads() -> list[int]:
    """Thread ids of live gloo worker threads in this process (Linux; [] where /proc is missing).
    Each gloo process group runs two ("pt_gloo_runloop"); none may be left when the interpreter exits."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    found = []
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as f:
                if f.read().strip() == "pt_gloo_runloop":
                    found.append(int(tid))
        except OSError:  # the thread ended while we looked
            continue
    return found


def _release_destroyed_groups() -> None:
    """Drop the references torch keeps to process groups after destroy_process_group().

    destroy_process_group() forgets every group but stops none: a gloo group's worker threads stop
    only when its last reference goes. Every DeviceMesh keeps its groups (`_pg_registry`), and meshes
    live on in DTensor's sharding and redistribution caches (DTensorSpec -> mesh) for the life of the
    process. (A closed engine drops its own references, and init_distributed imports the one torch
    module that would capture the default group in its function defaults before the group exists.)
    Left alive, the groups' threads run into interpreter finalization, where a worker that drops the
    last reference to a finished collective's tensor needs the GIL: CPython ends that thread inside
    a noexcept destructor and the process aborts with "terminate called without an active
    exception". Called after destroy_process_group(), when every group is dead anyway.
    """
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        # By the MRO, not isinstance: DeviceMesh's metaclass hooks isinstance, and through it every
        # object in the process would be probed (deprecated torch attributes warn when probed).
        if DeviceMesh in type(obj).__mro__:
            obj._pg_registry.clear()
    gc.collect()  # the groups' destructors join their worker threads, with the interpreter alive


def shutdown() -> None:
    """Leave the process group cleanly (after every engine is closed): barrier, destroy every group,
    and stop their worker threads before the interpreter exits (see _release_destroyed_groups)."""
    if dist.is_initialized():
        barrier(world_group())
        dist.destroy_process_group()
    _release_destroyed_groups()
    if gloo_worker_threads():
        warnings.warn(f"{len(gloo_worker_threads())} gloo worker threads outlive destroy_process_group(): "
                      f"something still holds a process group (an engine not closed?); the process may "
                      f"abort at exit", RuntimeWarning, stacklevel=2)
