"""Run a module under torchrun, or a backend's launcher, from a test (CPU, gloo), with this
interpreter's import path: the one helper every backend's tests and the conformance suite use."""

from __future__ import annotations

import os
import subprocess
import sys


# What common.parallel.distributed.init_distributed sets in a test process that made a world of one: a child
# inheriting it would take itself for a torchrun worker (and share the parent's rendezvous port).
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def worker_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
                TRL_EXPERIMENTAL_SILENCE="1", **extra)


def torchrun_command(nproc: int, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", module, *args]


def run_torchrun(nproc: int, module: str, *args: str, env: dict | None = None,
                 timeout: int = 600) -> subprocess.CompletedProcess:
    """MODULE ARGS on `nproc` ranks, output captured; assert every rank exited 0. torchrun's agent
    runs in this process (common.job.quiet_torchrun, as the launcher runs it: one interpreter fewer to
    start), and its ranks are forked from it where that is sound (common.job.forked_workers, as the
    launcher's are: they find torch and transformers imported); one rank needs no agent: `python -m
    MODULE`, a world of one (common.parallel.distributed)."""
    if nproc == 1:
        result = subprocess.run([sys.executable, "-m", module, *args], env=env or worker_env(), capture_output=True,
                                text=True, timeout=timeout)
    else:
        result = _main_in_process(_torchrun_forking_where_sound, "torchrun", *torchrun_command(nproc, module, *args)[3:],
                                  env=env)
    assert result.returncode == 0, f"torchrun {module} {args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


THEN = "+"  # separates the runs of one worker launch (argv_runs)


def argv_runs(argv: list[str]) -> list[list[str]]:
    """A test worker's argv as its runs, one after another in the same processes (one interpreter
    start for several): `RUN [+ RUN ...]`, each RUN the arguments of one."""
    runs, run = [], []
    for arg in argv:
        if arg == THEN:
            runs.append(run)
            run = []
        else:
            run.append(arg)
    return [*runs, run]


def then(*runs) -> list[str]:
    """The argv of several worker runs (argv_runs reads it back)."""
    return [str(arg) for i, run in enumerate(runs) for arg in ([THEN] if i else []) + list(run)]


def run_torchrun_group(nproc: int, module: str, names, args_of, tmp_path_factory, *leading: str,
                       env: dict | None = None) -> dict:
    """One torchrun of MODULE for several runs of the same process count: argv is LEADING, then
    per name its own work directory and `args_of(name)`; returns {name: work directory}."""
    works = {name: tmp_path_factory.mktemp(name) for name in names}
    run_torchrun(nproc, module, *leading, *(str(a) for name in names for a in (works[name], *args_of(name))), env=env)
    return works


def run_launcher(launcher: str, *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """python -m LAUNCHER ARGS (it relaunches itself under torchrun for --nproc > 1).

    A launch with `--nproc N > 1` (and no `env`) runs its launcher part in this process
    (run_launcher_in_process): the launcher only checks and then runs torchrun's agent, whose
    workers are new processes either way, and this process has torch imported already."""
    nproc = args[args.index("--nproc") + 1] if "--nproc" in args[:-1] else "1"
    if env is None and nproc.isdigit() and int(nproc) > 1:
        return run_launcher_in_process(launcher, *args)
    return subprocess.run([sys.executable, "-m", launcher, *args], env=env or worker_env(), capture_output=True,
                          text=True, timeout=timeout)


def _torchrun_forking_where_sound(args: list[str]) -> int:
    """torchrun ARGS (`--standalone --nproc_per_node=N -m MODULE ...`) by common.job.quiet_torchrun, the
    ranks forked from this process where common.job.forked_workers.start_method says so."""
    from ..job import forked_workers, quiet_torchrun

    threads = os.environ.get("OMP_NUM_THREADS", "")
    fork = forked_workers.start_method(int(threads) if threads.isdigit() else 0) == "fork"
    module = args[args.index("-m") + 1]
    return quiet_torchrun.main(args, forked_workers.run_as_main(module) if fork else None)


def run_launcher_in_process(launcher: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """LAUNCHER's main(ARGS) in this process: the exit code, stdout and stderr that `python -m
    LAUNCHER ARGS` gives, without the seconds a new interpreter spends importing torch. For launches
    that end before any process starts or trains (refusals, --dry-run, --print-config, --help), and
    for --nproc N > 1 ones, whose training runs in torchrun workers: they get `env` (worker_env()'s
    environment by default), and their output (file descriptors 1 and 2, which they inherit) is captured with
    the launcher's own lines. The environment is restored after."""
    import importlib

    return _main_in_process(importlib.import_module(launcher).main, launcher, *args, env=env)


def _main_in_process(main, name: str, *args: str, env: dict | None) -> subprocess.CompletedProcess:
    """main(ARGS) as run_launcher_in_process runs a launcher's: output captured, environment restored."""
    import contextlib
    import tempfile
    from unittest import mock

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, mock.patch.dict(os.environ):
        env = env or worker_env()
        os.environ.clear()
        os.environ.update(env)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(args))
                except SystemExit as exit_:  # argparse: --help, bad flags
                    code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
                out.flush()
                err.flush()
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([name, *args], code, out.read(), err.read())


def run_launcher_killed_after(launcher: str, step: int, *args: str, env: dict | None = None) -> list[str]:
    """python -m LAUNCHER ARGS, its whole process group SIGKILLed once the checkpoint of `step` is
    reported; returns the lines it printed (asserting it had not finished)."""
    import signal

    process = subprocess.Popen([sys.executable, "-m", launcher, *args], env=dict(env or worker_env(), PYTHONUNBUFFERED="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("checkpoint saved: ") and line.rstrip().endswith(f"/step_{step:06d}"):
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait(timeout=120)
    assert not any(line.startswith("final explained_variance") for line in seen), "run finished before the kill"
    _wait_until_released(args)
    return seen


def _wait_until_released(args) -> None:
    """Wait (60 s at most) for the killed launcher's workers to exit: they run in sessions of their own
    and leave when they see the launcher gone (common.job.lifeline), and until then rank 0 holds the
    run's lock, which a --resume rightly refuses."""
    import time

    from ..job.run_lock import check_not_in_use

    run_dirs = [arg.split("=", 1)[1] for arg in args if arg.startswith("trainer.run_dir=")]
    deadline = time.monotonic() + 60
    for run_dir in run_dirs:
        while True:
            try:
                check_not_in_use(os.path.abspath(run_dir))
                break
            except ValueError:
                assert time.monotonic() < deadline, f"the killed run's workers still hold {run_dir} after 60 s"
                time.sleep(0.2)


# SHORT_JOB's checkpoint of step 16: epoch 2 has begun (15 steps an epoch) and its first PPO iteration
# is one step in, so the resumed run needs the old values the iteration started with (common/job/trainer.py).
KILL_AFTER_STEP = 16


def assert_killed_run_resumes_identically(launcher: str, run_root, *args: str, env: dict | None = None,
                                          before_resume=None, whole_args=()) -> subprocess.CompletedProcess:
    """The whole run, and the same run SIGKILLed after its step-16 checkpoint then `--resume`d, end
    with bit-identical exports and the same final explained variance (run_root/whole, /killed).
    `before_resume(killed_dir)`: what to check on the killed run first (or copy it, to resume it
    another way too). `whole_args`: for the whole run only (outputs that leave the weights alone,
    such as trainer.plot=true). Returns the whole run's result, for the test to check what it learnt."""
    whole, killed = run_root / "whole", run_root / "killed"
    result = run_launcher(launcher, f"trainer.run_dir={whole}", *args, *whole_args, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    run_launcher_killed_after(launcher, KILL_AFTER_STEP, f"trainer.run_dir={killed}", *args, env=env)
    if before_resume is not None:
        before_resume(killed)
    _assert_resume_ends_like(result, whole, launcher, killed, *args, step=KILL_AFTER_STEP, env=env)
    return result


def _assert_resume_ends_like(whole_result, whole, launcher: str, run_dir, *args: str, step: int, env) -> None:
    """`--resume` of run_dir goes on from its checkpoint of `step` and ends with whole's exported
    weights, bit for bit, and its final explained variance."""
    import re

    from .helpers import assert_same_exported_weights, final_explained_variance

    resumed = run_launcher(launcher, f"trainer.run_dir={run_dir}", *args, "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert re.search(rf"resumed from \S*step_{step:06d} at epoch \d+, step {step}\n", resumed.stdout), \
        resumed.stdout[:3000]
    assert_same_exported_weights(whole, run_dir)
    assert final_explained_variance(resumed.stdout) == final_explained_variance(whole_result.stdout)


def assert_resume_from_a_checkpoint_is_identical(launcher: str, run_root, *args: str, step: int = KILL_AFTER_STEP,
                                                 env: dict | None = None, before_resume=None) -> subprocess.CompletedProcess:
    """The whole run, and a copy of its run_dir cut back to the checkpoint of `step` (the later
    checkpoints and the exports removed) then `--resume`d, end with bit-identical exports and the
    same final explained variance (run_root/whole, /resumed): what a feature's checkpoint must hold.
    One launch fewer than assert_killed_run_resumes_identically, for tests of a feature (LoRA, a
    head, a sequence split); what a kill leaves behind (a held lock, a staging directory, metrics
    past the checkpoint) is checked by each backend's kill test (backends/*/tests/test_training_job.py).
    `before_resume(resumed_dir)` as there. Returns the whole run's result."""
    import shutil

    whole, resumed_dir = run_root / "whole", run_root / "resumed"
    result = run_launcher(launcher, f"trainer.run_dir={whole}", *args, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    shutil.copytree(whole, resumed_dir)
    kept = f"step_{step:06d}"
    assert (resumed_dir / "checkpoints" / kept).is_dir(), sorted(os.listdir(resumed_dir / "checkpoints"))
    for name in os.listdir(resumed_dir / "checkpoints"):
        if name > kept:
            shutil.rmtree(resumed_dir / "checkpoints" / name)
    for name in ("hf_export", "hf_export_adapter"):
        shutil.rmtree(resumed_dir / name, ignore_errors=True)
    if before_resume is not None:
        before_resume(resumed_dir)
    _assert_resume_ends_like(result, whole, launcher, resumed_dir, *args, step=step, env=env)
    return result


def assert_resumed_run_follows(run_dir, whole_dir, *, steps: int, tolerance: float = 1e-4) -> None:
    """run_dir's train metrics (a killed run continued another way: other ranks, another layout)
    cover steps 1..`steps` and follow whole_dir's loss curve within `tolerance`."""
    from ..job.metrics import read_metrics

    expected = [r for r in read_metrics(str(whole_dir / "metrics.jsonl")) if r["split"] == "train"]
    got = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["split"] == "train"]
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, steps + 1))
    worst = max(abs(a["value_loss"] - b["value_loss"]) for a, b in zip(got, expected))
    assert worst <= tolerance, f"the continued run departs from the whole run's loss curve by {worst}"
