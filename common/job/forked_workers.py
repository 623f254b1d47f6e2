"""torchrun workers forked from the process that runs torchrun's agent, instead of new interpreters.

A spawned worker imports torch, transformers and the backend again (about 5 s of CPU per worker,
measured in docs/TESTS.md); a forked one has them from the launcher, which imported them to plan
the job. The ranks are otherwise what torchrun's own are: its configuration from the same
arguments (--standalone rendezvous included), its agent watching them, each rank in a session of
its own with default signal handlers and its thread count. start_method() says when a fork is sound;
common.job.quiet_torchrun runs the agent either way.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import sys
import uuid
from collections.abc import Callable

WORKER_START_ENV = "CRITIC_ADAPTERS_WORKER_START"


def start_method(threads_per_worker: int) -> str:
    """"fork" or "spawn" (fresh interpreters, as torchrun itself starts workers) for workers of this
    process. Fork only where a forked rank is sound: no CUDA (a CUDA context does not survive a fork,
    and the launcher's plan has asked the device for its memory), one OpenMP thread per worker (GNU
    OpenMP's thread pool does not survive a fork either: a forked rank whose multi-threaded op follows
    one of the parent's waits forever, measured), and no process group in this process (a rank would
    inherit it: a launcher has none; a test process that made a world of one in process has).
    CRITIC_ADAPTERS_WORKER_START=spawn turns it off."""
    choice = os.environ.get(WORKER_START_ENV, "auto")
    if choice not in ("auto", "spawn"):
        raise ValueError(f"{WORKER_START_ENV}={choice}: expected auto (the default) or spawn")
    if choice == "spawn" or threads_per_worker != 1 or not hasattr(os, "fork"):
        return "spawn"
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "spawn"
    if _agents_return_queue_name() is None:  # a torch whose agent this module does not know
        return "spawn"
    return "spawn" if torch.cuda.is_available() else "fork"


def _agents_return_queue_name() -> str | None:
    """The local name under which torchrun's agent code in a forked worker (torch.distributed.elastic's
    `_wrap`) holds the queue the worker's return value goes to, if this torch has it (see _report_exit)."""
    from torch.distributed.elastic.multiprocessing import api

    wrap = getattr(api, "_wrap", None)
    return "ret_val_" if wrap is not None and "ret_val_" in wrap.__code__.co_varnames else None


def run_as_main(module: str) -> Callable[[list[str]], int]:
    """A forked worker's main for `python -m MODULE ARGS`: the module run as __main__ with that argv;
    its exit code (SystemExit's, else 0)."""

    def main(argv: list[str]) -> int:
        sys.argv = [module, *argv]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            return done.code if isinstance(done.code, int) else int(done.code is not None)
        return 0

    return main


def torchrun_main(worker_main: Callable[[list[str]], int]) -> Callable[[list[str] | None], None]:
    """torchrun's main, except that its workers are forked and run worker_main(the script's arguments).

    SIGINT and SIGTERM are passed on to the workers by this process rather than by torchrun's agent:
    the agent, once signalled, stops collecting what its forked workers return, and a worker that
    drains and returns 0 after SIGTERM (the service's ranks) then waits for it until its shutdown
    timeout (30 s) kills it. Passed on here, the agent keeps collecting: the run ends as the workers
    end it (0 after a drain, 130 after Ctrl-C), or with 128 + the signal when it killed them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    def forking_main(args: list[str] | None) -> None:
        parsed = parse_args(args)
        if parsed.standalone:  # what torchrun's run() does for --standalone: one node, a local store, any free port
            parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        config, _, _ = config_from_args(parsed)
        config.start_method = "fork"
        config.signals_to_handle = "SIGHUP,SIGQUIT"  # SIGINT and SIGTERM: pass_on
        passed: list[int] = []

        def pass_on(number, _frame):
            workers = multiprocessing.active_children()
            if not workers:  # none started yet (or all gone): nothing to stop but this process
                raise SignalException(f"received {signal.Signals(number).name}", signal.Signals(number))
            passed.append(number)
            for worker in workers:
                os.kill(worker.pid, number)

        previous = {number: signal.signal(number, pass_on) for number in (signal.SIGINT, signal.SIGTERM)}
        sys.stdout.flush()  # what is still buffered here would be written again by every forked worker
        sys.stderr.flush()
        try:
            elastic_launch(config, _worker)(worker_main, list(parsed.training_script_args))
        except ChildFailedError as err:
            _, failure = err.get_first_failure()
            if passed and failure.exitcode == -passed[0]:  # killed by what it was passed: as torchrun ends
                raise SignalException(f"received {signal.Signals(passed[0]).name}", signal.Signals(passed[0])) from None
            raise
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    return forking_main


def _worker(worker_main: Callable[[list[str]], int], argv: list[str]) -> None:
    """A forked rank: made what a spawned torchrun worker is (a session of its own, its own signal
    handlers rather than the agent's, its thread count), named rank-N, then worker_main(argv). A
    failure ends the process with its exit code; success returns, for torchrun's agent to collect."""
    import torch

    from ..parallel import launch_log

    os.setsid()
    for number in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    _stop_as_a_spawned_rank()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _report_exit()
    launch_log.record_start()  # the package was imported before this process existed
    _name_process(f"rank-{os.environ.get('RANK', '?')}")
    code = worker_main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)


def _stop_as_a_spawned_rank() -> None:
    """SIGINT raises KeyboardInterrupt and SIGTERM ends the process, as in a new interpreter, with one
    difference: a SIGTERM after a SIGINT is ignored. The launcher passes Ctrl-C on to every rank, and
    the agent, once one rank has ended (130), stops the others with SIGTERM: rank 0, which reports
    where to resume, may still be inside a collective, its SIGINT not yet handled (a signal's Python
    handler runs when the C call returns, SIGINT's before SIGTERM's), and must not be ended before it
    reports. (A spawned rank gets the agent's SIGINT only after the agent has stopped watching.)"""
    interrupted: list[int] = []

    def on_interrupt(number, _frame):
        interrupted.append(number)
        raise KeyboardInterrupt

    def on_terminate(number, _frame):
        if interrupted:  # stopping already: this rank reports it and ends itself
            return
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_terminate)


def _report_exit() -> None:
    """Make os._exit(0) in this forked rank a success torchrun's agent sees.

    The agent counts a forked worker as done when its return value is on the worker's queue (a spawned
    one when it exits 0), so a rank that ends with os._exit(0), as ours do to skip the interpreter's
    teardown (common.job.launcher.exit_process; test workers after a timed-out collective), would leave
    it waiting for good. This rank's os._exit therefore puts the return value first when the code is 0."""
    name = _agents_return_queue_name()
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_wrap" and name in frame.f_locals):
        frame = frame.f_back
    if frame is None:
        return
    queue, leave = frame.f_locals[name], os._exit

    def exit_reporting(code: int) -> None:
        if code == 0:
            queue.put(None)
        leave(code)

    os._exit = exit_reporting


def _name_process(name: str) -> None:
    """Name this process (Linux's comm: `ps -o comm`, psutil's name()): a forked rank's command line
    and /proc environment are its parent's, so its name is what tells the ranks apart."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
