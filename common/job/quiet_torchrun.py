"""torchrun for the launcher's --nproc relaunch (run in the launcher's own process: one interpreter
fewer to start), minus torchrun's own report of what the workers already reported.

With `fork_main`, the workers are forked from this process and run fork_main(the script's
arguments) instead of starting the command (common.job.forked_workers: when that is sound, how).

Each worker prints its own one-line error (or "interrupted at step N") before it exits, so torchrun's
multi-line failure report and its traceback on Ctrl-C only bury that line. This keeps torchrun's
behaviour and exits with the failed worker's code (2 for a user error, 130 for Ctrl-C); only a worker
killed by a signal, which could not speak for itself, gets a line here.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable


def main(args: list[str] | None = None, fork_main: Callable[[list[str]], int] | None = None) -> int:
    """torchrun ARGS (sys.argv[1:] when None) in this process, its workers forked to run
    fork_main(the script's arguments) when given; the exit code as the module docstring says."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    if fork_main is not None:
        from .forked_workers import torchrun_main as forking_torchrun_main
        torchrun_main = forking_torchrun_main(fork_main)

    # torchrun's agent logs "Sending process N closing signal SIGTERM" and "failed (exitcode: 2)"
    # after the worker's own one-line error; its loggers took their level (LOGLEVEL) when torch
    # imported them, before the launcher could set it.
    # Forked workers are torch.multiprocessing's, whose logger says "Terminating process N via signal
    # SIGTERM" when the agent stops the others.
    elastic = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")] + [logging.getLogger("torch.multiprocessing.spawn")]
    levels = [logger.level for logger in elastic]
    for logger in elastic:
        logger.setLevel(logging.CRITICAL)
    try:
        return _run(torchrun_main, args, ChildFailedError, SignalException)
    finally:
        for logger, level in zip(elastic, levels):
            logger.setLevel(level)


def _run(torchrun_main, args, ChildFailedError, SignalException) -> int:
    try:
        torchrun_main(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode < 0:
            print(f"error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}", file=sys.stderr)
            return 1
        return failure.exitcode
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
