"""The one training launcher: arguments, YAML + overrides, checks, torchrun, faults.

  python -m <package>.train --backend NAME [CONFIG.yaml ...] [key=value ...] [--nproc N] [--resume]
                                          [--dry-run] [--print-config]
`python -m <package>.backends.<name>.train` is the same launcher with the backend fixed (a one-line
alias: LauncherSpec(backend=...)); `python -m <package>.integrations.ray.train` is the same launcher
with the engine's ranks in a Ray worker group instead of torchrun processes (LauncherSpec's
add_arguments and run). The backend comes from --backend, else the config's `backend`, else the
alias's; its default job is common/job/default_job.yaml under its BackendSpec's job_defaults
(common/engine/registry.py), which also says what it implements. Without --nproc it starts as many
processes as engine.parallel needs. Flags may come anywhere among the items. Without torchrun,
--nproc N > 1 relaunches the same module under torchrun, by the name it runs under (so a vendored
copy relaunches itself, not ours). Config, backend and run_dir are checked before any process group
exists; a failure on any rank ends every rank with one line; Ctrl-C is one line and exit code 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback
from collections.abc import Callable

INTERRUPTED = 130  # the shell's code for a job ended by Ctrl-C
DEFAULT_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_job.yaml")

LAYERS_HELP = """\
How the config is built (later wins, key by key): the built-in defaults (common/engine/config.py), the
embedded default job (common/job/default_job.yaml), the backend's own default settings (its BackendSpec's
job_defaults in common/engine/registry.py), your YAML files in order, then key=value overrides. --resume
with no YAML file starts from the run's own run_dir/config.yaml instead. --print-config shows the
result."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LauncherSpec:
    module: str
    """The launcher's own module name, as it runs (`__spec__.name`): what torchrun relaunches."""
    doc: str
    """The launcher's help text (its module docstring)."""
    backend: str | None = None
    """The registered backend an alias trains with; None: --backend or the config's `backend`
    (default fsdp) choose it."""
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    """Flags of its own (the Ray launcher's cluster and placement flags)."""
    run: Callable[[argparse.Namespace, object], int] | None = None
    """run(args, config) -> exit code, in this process, instead of torchrun processes running the
    trainer (the Ray launcher: the trainer drives a Ray worker group)."""
    job_defaults: tuple[str, ...] = ()
    """key=value settings of this launcher's own, a layer after the backend's job_defaults (the
    critic service's: a constant LR, its own run_dir)."""


def exit_process(code: int) -> None:
    """End a launcher's process (`python -m ...train`, and each torchrun worker) with `code` once
    its output is written, without the interpreter's teardown.

    Everything the job writes is closed by then (checkpoints, export, metrics; the process group
    is destroyed), so the teardown only frees torch's and transformers' modules: about a second per
    process (measured, 2 CPU cores), paid by the launcher and every worker of every run."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _parse(argv: list[str], spec: LauncherSpec) -> argparse.Namespace:
    first, _, rest = spec.doc.strip().partition("\n")
    parser = argparse.ArgumentParser(prog=f"python -m {spec.module}", description=first,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"{rest.strip()}\n\n{LAYERS_HELP}")
    parser.add_argument("items", nargs="*", help="YAML config files and key=value overrides")
    parser.add_argument("--backend", default=None,
                        help="the registered backend to train with (default: the config's, else "
                             f"{spec.backend or 'fsdp'})")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes (engine ranks) to start when not under torchrun (default: what "
                             "engine.parallel needs)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
    parser.add_argument("--dry-run", action="store_true", help="check config, model and rollouts; do not train")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="the memory of one device (e.g. 80GB), for the plan's `memory per rank:` line to say "
                             "whether a rank fits (default: the local CUDA device's, if any)")
    if spec.add_arguments is not None:
        spec.add_arguments(parser)
    # Intermixed: flags may come after overrides (`cfg.yaml lr=1 --resume x=2`).
    return parser.parse_intermixed_args(argv)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _relaunch_under_torchrun(nproc: int, argv: list[str], module: str, main: Callable[[list[str]], int]) -> int:
    """Run this module's workers under torchrun's agent in this process (common.job.quiet_torchrun) and
    wait; returns the failed worker's exit code. Spawned workers run `python -m module argv`; forked
    ones (common.job.forked_workers, where sound) call `main(argv)`, what that module runs. The workers
    watch this pid and exit when it is gone (common.job.lifeline); Ctrl-C here reaches the workers once
    (each runs in a session of its own), so that they stop and report where."""
    from .forked_workers import start_method
    from .lifeline import LAUNCHER_PID_ENV
    from .quiet_torchrun import main as torchrun

    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        forked = start_method(int(threads) if threads.isdigit() else 0) == "fork"
    except ValueError as err:
        say_error(str(err))
        return 2
    os.environ.update(OMP_NUM_THREADS=threads, **{LAUNCHER_PID_ENV: str(os.getpid())})
    os.environ.setdefault("LOGLEVEL", "ERROR")  # torchrun's own warnings repeat what the workers say
    # By name, relative to wherever this package lives (vendored copies included).
    try:
        return torchrun(["--standalone", f"--nproc_per_node={nproc}", "-m", module, *argv], main if forked else None)
    except KeyboardInterrupt:  # before torchrun's agent took the signal over
        return INTERRUPTED


def _user_layers(args, spec: LauncherSpec) -> tuple[list[str], list[str], str | None]:
    """(the user's YAML files, overrides, the run's saved config.yaml when --resume has no YAML)."""
    from ..engine.config import load_train_config

    yamls = [item for item in args.items if "=" not in item]
    overrides = [item for item in args.items if "=" in item]
    if args.resume:
        overrides.append("trainer.resume=true")
    saved = None
    if args.resume and not yamls:  # the run_dir the backend's default job would use (megatron's is its own)
        from ..engine.config import declared_backend
        from ..engine.registry import backend_spec

        backend = args.backend or declared_backend([], overrides) or spec.backend or "fsdp"
        defaults = ("job_defaults", backend_spec(backend).job_defaults)
        own = [("launcher defaults", spec.job_defaults)] if spec.job_defaults else []
        run_dir = load_train_config([DEFAULT_JOB, defaults, *own], overrides).trainer.run_dir
        saved = os.path.join(os.path.abspath(run_dir), "config.yaml")
        saved = saved if os.path.isfile(saved) else None
    return yamls, overrides, saved


def _choose_backend(args, spec: LauncherSpec, yamls: list[str], overrides: list[str], saved: str | None) -> str:
    """--backend, else the config's `backend`, else the alias's, else fsdp; an alias refuses another."""
    from ..engine.config import declared_backend
    from ..engine.registry import backend_spec

    declared = declared_backend([saved] if saved else yamls, overrides)
    backend = args.backend or declared or spec.backend or "fsdp"
    backend_spec(backend)  # registered at all: ValueError naming the registered ones
    if args.backend and declared and declared != args.backend:
        raise ValueError(f"--backend {args.backend}, but the config says backend={declared}: drop one of them")
    if spec.backend is not None and backend != spec.backend:
        raise ValueError(f"backend={backend} in the config, but this is the {spec.backend} launcher; run "
                         f"python -m {spec.module.replace(f'.{spec.backend}.', f'.{backend}.')} (or the one "
                         f"launcher with --backend {backend}) instead, or drop backend from the config")
    return backend


def _load_config(args, spec: LauncherSpec, *, say=print):
    """The config from its layers; raises ValueError.

    Layers, later wins key by key: the dataclass defaults, the embedded default job, the backend's
    job_defaults, the user's YAML files in order, then key=value overrides. `--resume` with no YAML
    file starts from the run's own config.yaml (run_dir/config.yaml, what ran) instead of the
    defaults.
    """
    from ..engine.config import load_train_config
    from ..engine.registry import backend_spec

    try:
        yamls, overrides, saved = _user_layers(args, spec)
        backend = _choose_backend(args, spec, yamls, overrides, saved)
        if saved:
            config = load_train_config([saved], overrides)
            if not args.print_config:
                say(f"resume: the run's settings from {saved}, with the command line's overrides")
            return config
        defaults = (f"the {backend} backend's job_defaults", (f"backend={backend}", *backend_spec(backend).job_defaults))
        own = [(f"python -m {spec.module}'s defaults", spec.job_defaults)] if spec.job_defaults else []
        return load_train_config([DEFAULT_JOB, defaults, *own, *yamls], overrides)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None


def _plan(args, config):
    """The job's plan (common.job.plan) for --nproc processes (None: the resumed run's count, else what
    engine.parallel needs), and the run_dir writable; ValueError before any process starts or
    anything is written. The dry run and the launch make the same plan."""
    from ..engine.registry import check_engine_config, check_installed
    from ..storage.atomic_dir import unwritable_reason
    from .plan import plan_job

    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: the process count must be >= 1")
    check_engine_config(config.backend, config.engine)  # what the backend lacks whatever the process count
    check_installed(config.backend)  # its library, before any process starts
    try:
        plan = plan_job(config, args.nproc)
    except ValueError as err:
        # A process-count refusal names the count asked for (a run-dir or model refusal holds at any count).
        where = f" (--nproc {args.nproc})" if args.nproc is not None and "process" in str(err) and \
            "--nproc" not in str(err) else ""
        raise ValueError(f"{err}{where}{_job_default_note(config, str(err))}") from None
    reason = unwritable_reason(config.trainer.run_dir) if not args.dry_run else None  # a dry run writes nothing
    if reason:
        raise ValueError(f"trainer.run_dir={config.trainer.run_dir} is not writable: {reason}; choose another "
                         f"trainer.run_dir")
    return plan


def _memory_line(args, plan) -> str:
    """The plan's `memory per rank:` line (common.engine.memory), against --device-memory or the local device."""
    from ..engine.memory import local_device_memory, parse_size, plan_memory_line

    device = parse_size(args.device_memory) if args.device_memory else local_device_memory()
    return plan_memory_line(plan, device)


def _job_default_note(config, message: str) -> str:
    """' (engine.parallel.tensor=2 is the megatron backend's job default; ...)' when a refusal may come
    from a parallel degree the backend's job_defaults set rather than the user."""
    from ..engine.config import flat_values
    from ..engine.registry import backend_spec

    values = flat_values(config)
    inherited = [setting for setting in backend_spec(config.backend).job_defaults
                 if setting.startswith("engine.parallel.") and str(values[setting.split("=")[0]]) == setting.split("=")[1]
                 and ("processes" in message or setting.split("=")[0] in message)]
    if not inherited:
        return ""
    return (f" ({', '.join(inherited)}: the {config.backend} backend's job default; override it, e.g. "
            f"{inherited[0].split('=')[0]}=1, if the layout should differ)")


def say(message: str) -> None:
    # Flushed at once: the workers torchrun starts write to the same stdout, and a line still in
    # this process's buffer would come out after all of theirs.
    print(message, flush=True)


def say_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def parse_command_line(spec: LauncherSpec, argv: list[str] | None) -> tuple[list[str], argparse.Namespace]:
    """(argv, its parsed arguments); under `bazel run`, relative paths mean the user's directory."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "BUILD_WORKING_DIRECTORY" in os.environ:
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])
    return argv, _parse(argv, spec)


def configured(args, spec: LauncherSpec):
    """The config of a parsed command line (ValueError / OSError / ImportError when it is refused), said once
    (by the launching process); None once --print-config has printed it."""
    quiet = "LOCAL_RANK" in os.environ or os.environ.get("RANK", "0") != "0"
    config = _load_config(args, spec, say=(lambda *a, **k: None) if quiet else say)
    if args.print_config:
        from ..engine.config import to_yaml

        print(to_yaml(config))
        return None
    return config


def launch(spec: LauncherSpec, argv: list[str] | None = None) -> int:
    """The whole launcher: parse, check, (re)launch under torchrun, train; returns the exit code."""
    argv, args = parse_command_line(spec, argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    rank0 = os.environ.get("RANK", "0") == "0"
    # The config, then (outside torchrun) the job's plan: backend, layout, model and run_dir checked
    # before any process starts or anything is written; one line, once. A torchrun worker plans in
    # the trainer, on every rank of its world.
    try:
        config = configured(args, spec)
        if config is None:
            return 0
        plan = None if under_torchrun else _plan(args, config)
        memory = None if under_torchrun else _memory_line(args, plan)
    except (ValueError, OSError, ImportError) as err:  # ImportError: the backend's library (check_installed)
        if rank0:
            say_error(str(err))
        return 2
    if under_torchrun:
        return _run(config)
    if args.dry_run:
        from .trainer import dry_run

        try:
            dry_run(plan, say=say, memory=memory)
        except BaseException as err:  # noqa: BLE001 - reported as a launch reports it
            return fail(err, None)
        return 0
    if args.nproc is None and plan.processes > 1:
        why = plan.processes_note or ("the engine.parallel layout's tensor x pipeline x context x ulysses"
                                      + (" x replicate" if config.engine.parallel.replicate > 1 else "")
                                      + " (--nproc N for more data-parallel ranks)")
        print(f"starting {plan.processes} processes, {why}", flush=True)
    say(memory)  # after the process count: the first line says how many processes start
    args.nproc = plan.processes  # what a spec's run starts (the Ray launcher's workers)
    if spec.run is not None:
        return spec.run(args, config)
    if plan.processes > 1:
        return _relaunch_under_torchrun(plan.processes, [*_without_nproc(argv)], spec.module,
                                        functools.partial(launch, spec))
    return _run(config)


def _run(config) -> int:
    from ..parallel.distributed import init_distributed, shutdown
    from .lifeline import LAUNCHER_PID_ENV, exit_when_gone
    from .trainer import run_training

    if LAUNCHER_PID_ENV in os.environ:
        exit_when_gone(int(os.environ[LAUNCHER_PID_ENV]))
    dist = None
    try:
        dist = init_distributed(timeout_s=config.engine.collective_timeout_s)
        run_training(config, dist)
    except BaseException as err:  # noqa: BLE001 - every failure ends this rank; see fail
        return fail(err, dist)
    shutdown()
    return 0


def fail(err: BaseException, dist) -> int:
    """Report a failure and end this rank at once.

    With several ranks, the others may be waiting in a collective for this one, so it never enters
    the shutdown barrier: it exits, and torchrun stops the rest. A ValueError or OSError is the
    user's to fix and usually happens on every rank alike, so rank 0 reports it; another rank waits
    a moment for rank 0 to do so (torchrun then stops it) and reports it itself only if rank 0 did not.
    Anything else is a bug: every rank that hits it prints its traceback.
    """
    from .trainer import TrainingInterrupted

    world = dist.world_size if dist is not None else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.rank if dist is not None else int(os.environ.get("RANK", "0"))
    where = f"rank {rank}: " if world > 1 else ""
    if isinstance(err, (TrainingInterrupted, KeyboardInterrupt)):
        if rank == 0:
            message = err.message() if isinstance(err, TrainingInterrupted) else "interrupted before training began"
            print(message, file=sys.stderr, flush=True)
        code = INTERRUPTED
    elif isinstance(err, (ValueError, OSError)):
        if rank != 0:
            time.sleep(3.0)
        say_error(f"{where if rank != 0 else ''}{err}")
        code = 2
    else:
        traceback.print_exception(err, file=sys.stderr)
        say_error(f"{where}{type(err).__name__}: {err}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if world > 1:
        os._exit(code)
    if dist is not None:
        from ..parallel.distributed import shutdown

        _drop_frames(err)  # what failed may hold process groups in its frames' locals (a half-built engine's mesh)
        shutdown()
    return code


def _drop_frames(err: BaseException | None) -> None:
    """Clear the locals of the finished frames in `err`'s tracebacks (and its causes'), so that what
    they referenced can be freed before the process group is torn down."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__
