"""Serve a PPO critic over HTTP: python -m critic_adapters.serve [CONFIG.yaml ...] [key=value ...] --token-file F

  python -m critic_adapters.serve --token-file user.token --admin-token-file admin.token --nproc 2
  python -m critic_adapters.serve cfg.yaml --token-file t --port 8000 --resume     # a run's last checkpoint
  python -m critic_adapters.serve --token-file t --ray --nproc 2                   # ranks as Ray actors

The training launcher's config, layout, flags and key=value overrides (python -m critic_adapters.train;
the service's defaults: a constant LR without warm-up, trainer.run_dir=outputs/serve), then the critic
behind FastAPI on uvicorn: torchrun ranks with rank 0 serving (serve/ranks.py), or a RayCriticGroup
driven from this process (--ray; --address joins a cluster). It prints `serving on http://H:P` once it
answers. Routes, statuses and the client: docs/SERVE.md. SIGTERM (or Ctrl-C) stops accepting, finishes
what is in flight, saves when --save-on-exit, and exits 0.

Exactly-once updates: every answered update is in run_dir/serve/journal.jsonl (fsync'd before its
answer) until the next checkpoint (--save-every N updates); --resume loads the last checkpoint and
applies the journal again, so a retried update is applied once across a restart too.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import threading

from ..common.parallel import launch_log
from ..common.job.launcher import (LauncherSpec, _relaunch_under_torchrun, _without_nproc, configured,
                                   exit_process, fail, parse_command_line, say, say_error)

SERVE_DEFAULTS = ("engine.optim.lr_schedule=constant", "engine.optim.warmup_ratio=null",
                  "trainer.run_dir=outputs/serve")
"""A service has no data to count its steps from: a constant LR, no warm-up ratio (engine.optim.warmup_steps
still works), and a run_dir of its own."""
STATUS_ENV = "CRITIC_SERVE_STATUS_FILE"
"""Where rank 0 says it stopped cleanly: torchrun's agent ends with the signal's code even then."""
JOURNAL = os.path.join("serve", "journal.jsonl")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the service")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    group.add_argument("--token-file", help="file holding the bearer token every route but /v1/health needs "
                                            "(required; tokens never go on the command line)")
    group.add_argument("--admin-token-file", help="file holding the admin token (save, load, offload, onload); "
                                                  "without it the admin routes are off")
    group.add_argument("--token-budget", type=int, default=16384,
                       help="tokens in one engine values call when batching requests (default 16384)")
    group.add_argument("--max-wait-ms", type=float, default=5.0,
                       help="how long a values request waits for others to join its engine call (default 5)")
    group.add_argument("--max-queue", type=int, default=1024, help="requests waiting at once; more get 429 (default 1024)")
    group.add_argument("--max-body-bytes", type=int, default=64 << 20, help="largest request body (default 64 MiB)")
    group.add_argument("--max-rows", type=int, default=256, help="rows in one request (default 256)")
    group.add_argument("--save-every", type=int, default=50,
                       help="checkpoint every N updates, which also empties the journal (default 50; 0: only "
                            "when asked and at exit with --save-on-exit)")
    group.add_argument("--journal-limit-mb", type=int, default=1024,
                       help="checkpoint when the journal of updates since the last one passes this size, whatever "
                            "--save-every says (default 1024)")
    group.add_argument("--max-parsing", type=int, default=4,
                       help="request bodies read and parsed at once (default 4); up to --max-queue more wait, "
                            "more than that get 429")
    group.add_argument("--save-on-exit", action="store_true", help="checkpoint after the last request on SIGTERM")
    group.add_argument("--no-batching", action="store_true", help="one engine call per values request (a baseline)")
    group.add_argument("--areal-minibatches", type=int, default=4,
                       help="optimizer steps of one AReaL update request, one per mini-batch of its rows: AReaL's "
                            "critic.ppo_n_minibatches (default 4, AReaL's default; docs/AREAL.md)")
    group.add_argument("--ray", action="store_true", help="the engine's ranks as Ray actors in this process's group")
    group.add_argument("--address", default=None, help="with --ray: a Ray cluster to join (default: a local one)")


def read_token(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"{flag} {path}: the file must hold one token (no spaces), it holds "
                         f"{'nothing' if not token else 'spaces'}")
    if len(token) < 16:
        raise ValueError(f"{flag} {path}: a token of {len(token)} characters is too easy to guess; use at least 16 "
                         f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path})")
    return token


def _tokens(args) -> tuple[str, str | None]:
    if args.token_file is None:
        raise ValueError("--token-file is required: a file holding the bearer token clients send")
    user = read_token(args.token_file, "--token-file")
    admin = read_token(args.admin_token_file, "--admin-token-file")
    if admin is not None and admin == user:
        raise ValueError("--admin-token-file holds the same token as --token-file: the admin token must differ")
    return user, admin


def check_run_dir(config, *, resume: bool) -> str | None:
    """The serving run's checkpoint to load (None: none), or ValueError: a fresh server in a run_dir with
    checkpoints or a journal, a --resume with neither, a run_dir another run holds or one not writable."""
    from ..common.job.run_lock import check_not_in_use
    from ..common.storage import checkpoints
    from ..common.storage.atomic_dir import unwritable_reason

    run_dir = os.path.abspath(config.trainer.run_dir)
    check_not_in_use(run_dir, wait_s=10)  # a restart right after a kill: the old ranks are still leaving
    latest = checkpoints.find_latest(os.path.join(run_dir, "checkpoints"))
    journal = os.path.join(run_dir, JOURNAL)
    has_journal = os.path.isfile(journal) and os.path.getsize(journal) > 0
    if not resume and (latest or has_journal):
        what = os.path.basename(latest) if latest else "updates in serve/journal.jsonl"
        raise ValueError(f"{run_dir} already holds a critic's state ({what}); pass --resume to serve it, or choose "
                         f"another trainer.run_dir")
    if resume and not (latest or has_journal):
        raise ValueError(f"--resume: {run_dir} holds no checkpoint and no journal to serve; start without --resume")
    reason = unwritable_reason(config.trainer.run_dir)
    if reason:
        raise ValueError(f"trainer.run_dir={config.trainer.run_dir} is not writable: {reason}")
    return latest


def _check(args, config) -> int:
    """Every check before a process starts; returns the process count."""
    from ..common.engine.registry import check_engine_config, check_installed, check_layout

    for flag in ("token_budget", "max_queue", "max_body_bytes", "max_rows", "journal_limit_mb", "max_parsing",
                 "areal_minibatches"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    if args.max_wait_ms < 0 or args.save_every < 0:
        raise ValueError("--max-wait-ms and --save-every must be >= 0")
    if config.engine.optim.lr_schedule == "cosine" and config.engine.optim.total_steps is None:
        raise ValueError("engine.optim.lr_schedule=cosine needs engine.optim.total_steps for a service (it has no data "
                         "to count steps from), or use lr_schedule=constant")
    check_engine_config(config.backend, config.engine)
    check_installed(config.backend)
    processes = args.nproc or config.engine.parallel.min_world_size
    if not config.engine.model.path.startswith("embedded:"):
        check_layout(config.backend, config.engine, processes)
    check_run_dir(config, resume=args.resume)
    return processes


def main(argv: list[str] | None = None) -> int:
    spec = LauncherSpec(module=__spec__.name.rsplit(".", 1)[0], doc=__doc__, add_arguments=add_serve_arguments,
                        job_defaults=SERVE_DEFAULTS)
    argv, args = parse_command_line(spec, argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        config = configured(args, spec)
        if config is None:
            return 0
        tokens = _tokens(args)
        processes = None if under_torchrun else _check(args, config)
    except (ValueError, OSError, ImportError) as err:
        if rank0:
            say_error(str(err))
        return 2
    if args.dry_run:
        say(f"would serve the {config.backend} critic of {config.engine.model.path} on {processes} rank(s) "
            f"({config.engine.parallel.describe(processes)}) at http://{args.host}:{args.port}, run_dir "
            f"{os.path.abspath(config.trainer.run_dir)}")
        return 0
    if args.ray and not under_torchrun:
        return _serve_on_ray(args, config, tokens, processes)
    if processes is not None and processes > 1:
        return _torchrun(args, argv, spec, processes)
    return serve_rank(args, config, tokens)


def _torchrun(args, argv: list[str], spec: LauncherSpec, processes: int) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="critic-serve-") as tmp:
        status = os.path.join(tmp, "status")
        os.environ[STATUS_ENV] = status
        code = _relaunch_under_torchrun(processes, [*_without_nproc(argv)], spec.module, main)
        clean = os.path.isfile(status)
    # SIGTERM / Ctrl-C are passed on to the ranks (by torchrun's agent, or by this process for forked
    # ranks: common.job.forked_workers); the agent ends with 128 + the signal even when rank 0 drained
    # and every rank exited 0.
    return 0 if clean and code in (0, 130, 143) else code


def _critic_config(config, model_path: str, processes: int):
    import dataclasses

    from ..common.engine.registry import check_layout

    engine = dataclasses.replace(config.engine, model=dataclasses.replace(config.engine.model, path=model_path))
    return check_layout(config.backend, engine, processes).critic_config


def serve_rank(args, config, tokens) -> int:
    """One torchrun rank (or the only process): build the engine; rank 0 serves, the others follow."""
    import dataclasses

    from ..common.engine.registry import build_engine
    from ..common.job.lifeline import LAUNCHER_PID_ENV, exit_when_gone
    from ..common.job.trainer import resolve_model_path
    from ..common.parallel.distributed import init_distributed, shutdown
    from .crash_points import CrashPoints
    from .ranks import LeaderGone, RankZeroCritic, close_command_group, command_group, follow, rank_processes

    if LAUNCHER_PID_ENV in os.environ:
        exit_when_gone(int(os.environ[LAUNCHER_PID_ENV]))
    dist = None
    try:
        timeout = config.engine.collective_timeout_s
        dist = init_distributed(timeout_s=timeout)
        run_dir = os.path.abspath(config.trainer.run_dir)
        if dist.is_main:
            os.makedirs(run_dir, exist_ok=True)
        model_path = resolve_model_path(config.engine.model.path, run_dir, dist)
        engine_config = dataclasses.replace(config.engine, model=dataclasses.replace(config.engine.model,
                                                                                      path=model_path))
        engine = build_engine(config.backend, engine_config, dist)
        group = command_group(dist.world_size)
        processes = rank_processes(group)
        if not dist.is_main:
            try:
                follow(engine, group, timeout, CrashPoints())
            except LeaderGone as err:  # one line: rank 0's own output says why it went
                say_error(f"rank {dist.rank}: {err}")
                exit_process(1)
            close_command_group(group)
            group = None  # its gloo threads end with the last reference
            engine.close()
            shutdown()
            return 0
        critic, group = RankZeroCritic(engine, group, timeout, processes), None
        try:
            serve(critic, args, config, tokens, _critic_config(config, model_path, dist.world_size), say=say)
        except ServiceFailed as err:  # said in one line; the other ranks may be gone or waiting: no goodbye
            say_error(str(err))
            exit_process(1)
        critic.close()
        engine.close()
    except BaseException as err:  # noqa: BLE001 - reported as the training launcher reports it
        return fail(err, dist)
    shutdown()
    if os.environ.get(STATUS_ENV):
        open(os.environ[STATUS_ENV], "w").close()
    return 0


def _serve_on_ray(args, config, tokens, processes: int) -> int:
    import dataclasses

    import torch

    from ..common.job.trainer import resolve_model_path
    from ..common.parallel.distributed import DistContext
    from ..integrations.ray.cluster import ensure_ray, shutdown_ray
    from ..integrations.ray.group import RayCriticGroup

    driver = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    try:
        ensure_ray(args.address)
        run_dir = os.path.abspath(config.trainer.run_dir)
        os.makedirs(run_dir, exist_ok=True)
        model_path = resolve_model_path(config.engine.model.path, run_dir, driver)
        engine_config = dataclasses.replace(config.engine, model=dataclasses.replace(config.engine.model,
                                                                                      path=model_path))
        say(f"starting {processes} Ray worker(s)")
        with RayCriticGroup(config.backend, engine_config, processes) as group:
            serve(group, args, config, tokens, _critic_config(config, model_path, processes), say=say)
    except ServiceFailed as err:
        say_error(str(err))
        return 1
    except BaseException as err:  # noqa: BLE001
        return fail(err, None)
    finally:
        shutdown_ray()
    return 0


class ServiceFailed(RuntimeError):
    """The service stopped because it could not go on (Batcher.fail's reason): the process exits non-zero."""


@dataclasses.dataclass(slots=True)
class Service:
    """The service's parts over one critic (build_service)."""

    server: object
    """uvicorn.Server: run() serves until SIGTERM / SIGINT / should_exit."""
    batcher: object
    """serve.batcher.Batcher: the engine thread (start() before serving)."""
    bodies: object
    """serve.bodies.Bodies: close() after serving."""
    updates: object
    """serve.updates.Updates: start_fresh() or resume(...) before serving."""


def service_arguments(**flags) -> argparse.Namespace:
    """The service's flags (add_serve_arguments) at their defaults, with `flags` set (by their dest names)."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    unknown = sorted(set(flags) - set(vars(args)))
    if unknown:
        raise ValueError(f"not flags of the service: {unknown}")
    vars(args).update(flags)
    return args


def request_limits(critic_config, args):
    from .schema import Limits

    text = critic_config.get_text_config()
    return Limits(vocab_size=text.vocab_size, max_positions=getattr(text, "max_position_embeddings", None),
                  max_rows=args.max_rows, max_tokens=max(args.token_budget, 65536),
                  areal_minibatches=args.areal_minibatches)


def build_service(critic, args, *, run_dir: str, keep_last: int, tokens: tuple[str, str | None], critic_config,
                  limits=None, crash=None, say=print) -> Service:
    """The door, the engine thread and the exactly-once updates over `critic` (RankZeroCritic,
    RayCriticGroup, or anything with their surface), journaling into run_dir/serve and checkpointing into
    run_dir/checkpoints. A failure of the service (Batcher.fail) tells the server to stop."""
    import uvicorn

    from .app import build_app
    from .batcher import Batcher, BatchingConfig
    from .bodies import Bodies
    from .crash_points import CrashPoints
    from .ledger import Journal
    from .metrics import Metrics
    from .updates import Updates

    crash = crash or CrashPoints("")
    limits = limits or request_limits(critic_config, args)
    metrics = Metrics()
    journal = Journal(os.path.join(run_dir, JOURNAL), crash_mid_line=crash.mid_line if crash.armed else None)
    updates = Updates(critic, journal=journal, checkpoint_root=os.path.join(run_dir, "checkpoints"),
                      save_every=args.save_every, journal_limit_bytes=args.journal_limit_mb << 20, keep_last=keep_last,
                      metrics=metrics, crash=crash, say=say)
    service = None

    def stop_serving(_reason: str) -> None:  # Batcher.fail, from any thread: uvicorn polls should_exit
        service.server.should_exit = True

    batcher = Batcher(critic, BatchingConfig(token_budget=args.token_budget, max_wait_s=args.max_wait_ms / 1000,
                                             max_queue=args.max_queue, batching=not args.no_batching),
                      updates=updates, metrics=metrics, on_fatal=stop_serving, say=say)
    bodies = Bodies(limits=limits, critic_config=critic_config, max_body_bytes=args.max_body_bytes,
                    max_parsing=args.max_parsing, max_waiting=args.max_queue)
    app = build_app(batcher, bodies, user_token=tokens[0], admin_token=tokens[1], metrics=metrics)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False, lifespan="off"))
    service = Service(server, batcher, bodies, updates)
    return service


def serve_in_thread(critic, run_dir: str, tokens: tuple[str, str | None], *, critic_config=None, limits=None,
                    say=lambda *_: None, **flags):
    """(service, url, stop) of the service over `critic` in a thread of this process, on a free loopback port
    (flags: service_arguments'): a one-rank engine or a stand-in critic behind the real door, for tests and
    tools/gpu-check. stop() ends the server and the engine thread."""
    import time

    args = service_arguments(**{"port": 0, **flags})
    service = build_service(critic, args, run_dir=run_dir, keep_last=1, tokens=tokens, critic_config=critic_config,
                            limits=limits, say=say)
    service.batcher.start()
    thread = threading.Thread(target=service.server.run, daemon=True)
    thread.start()
    while not service.server.started:  # a thread's start: it either starts or the caller hangs
        assert thread.is_alive(), "the server thread ended"
        time.sleep(0.01)

    def stop():
        service.server.should_exit = True
        thread.join(60)
        service.batcher.stop()
        service.bodies.close()
        service.updates.journal.close()
    return service, f"http://127.0.0.1:{service.server.servers[0].sockets[0].getsockname()[1]}", stop


def serve(critic, args, config, tokens, critic_config, *, say=print) -> None:
    """The server over `critic` (RankZeroCritic or RayCriticGroup) until SIGTERM / Ctrl-C, or ServiceFailed."""
    import functools

    from ..common.engine.config import to_yaml
    from ..common.job.run_lock import run_dir_lock
    from ..common.storage import checkpoints
    from .crash_points import CrashPoints
    from .schema import update_request

    run_dir = os.path.abspath(config.trainer.run_dir)
    root = os.path.join(run_dir, "checkpoints")
    limits = request_limits(critic_config, args)
    with run_dir_lock(run_dir):
        os.makedirs(root, exist_ok=True)
        checkpoints.remove_staging_leftovers(root)  # an interrupted save's; complete checkpoints stay
        if not (args.resume and os.path.isfile(os.path.join(run_dir, "config.yaml"))):  # a run's own stays
            with open(os.path.join(run_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(config))
        service = build_service(critic, args, run_dir=run_dir, keep_last=config.trainer.keep_last, tokens=tokens,
                                critic_config=critic_config, limits=limits, crash=CrashPoints(), say=say)
        batcher, updates = service.batcher, service.updates
        if args.resume:
            updates.resume(functools.partial(update_request, limits=limits, critic_config=critic_config))
        else:
            updates.start_fresh()
        # What the engine, the load and the first save made lives as long as the server: out of the
        # collector's way, so that its full passes stay short while requests are answered.
        gc.collect()
        gc.freeze()
        batcher.start()
        threading.Thread(target=_announce, args=(service.server, args.host, say), daemon=True).start()
        # uvicorn raises the signal that stopped it again once it has, under the handlers it found: these
        # make that a no-op, so that the queued work, the save and a clean exit still happen.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            service.server.run()  # until SIGTERM / SIGINT / Batcher.fail: stops accepting, answers those in flight
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            service.bodies.close()
        batcher.health()  # a rank lost while no request was in flight fails the service here
        if batcher.failure is None:
            say("stopping: finishing the queued work")
        batcher.stop()
        if batcher.failure is not None:
            raise ServiceFailed(f"stopped at version {batcher.version}: {batcher.failure}")
        if args.save_on_exit:
            updates.save(None)
        updates.journal.close()
    say(f"stopped at version {batcher.version}")


def _announce(server, host: str, say) -> None:
    import time

    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    launch_log.ready("serving")
    say(f"serving on http://{host}:{port}")
