"""A training job's plan, made once before anything starts or is written, by the same functions
wherever it is made.

  config -> processes: --nproc, else (--resume) the count the run last ran with, else the fewest
            the layout runs on (engine.parallel.min_world_size: replicas and expert ranks included)
         -> the run directory, read only: not in use, no checkpoints for a fresh run; for --resume a
            complete checkpoint, the prepared rollouts and the run's config.yaml, which the config
            may differ from only in CHANGEABLE_ON_RESUME keys (check_run)
         -> the checkpoint read once and every refusal of the backend for this layout and model
            (common.engine.registry.check_layout: the functions the engines call when built)

The launcher makes the plan before it starts a process (a dry run prints it and stops); each
torchrun worker makes it again for its own world inside the trainer. What a refused plan leaves
behind: nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..engine.config import CHANGEABLE_ON_RESUME, TrainConfig, config_changes, load_train_config
from ..engine.registry import ModelRead, check_layout
from ..storage import checkpoints
from .run_lock import check_not_in_use

PREPARED = "prepared_rollouts.pt"
LAUNCH_FILE = "launch.json"
"""run_dir/launch.json: {"processes": N} of the run's latest launch, so that --resume without
--nproc continues on as many processes."""


@dataclasses.dataclass(frozen=True, slots=True)
class ResumePoint:
    """The run --resume continues."""

    latest: str
    """Its latest complete checkpoint directory."""
    saved: TrainConfig
    """Its config.yaml: what ran."""
    changes: tuple[tuple[str, object, object], ...]
    """(key, the run's value, this config's) of every changeable key that differs."""
    processes: int | None
    """The process count it last ran with (None: a run from before launch.json)."""

    def lines(self) -> list[str]:
        out = []
        for key, old, new in self.changes:
            note = ""
            if key == "trainer.epochs" and self.saved.engine.optim.total_steps:
                note = f" (the LR schedule still spans the run's {self.saved.engine.optim.total_steps} steps)"
            out.append(f"resume: {key} changed from {old!r} to {new!r}{note}")
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class JobPlan:
    config: TrainConfig
    processes: int
    """Engine ranks: torchrun processes or Ray workers."""
    model: ModelRead
    """engine.model.path read once (critic config, load plan)."""
    resume: ResumePoint | None
    processes_note: str = ""
    """Why this process count, when it is not what the user asked for or the layout's minimum."""

    @property
    def vocab_size(self) -> int:
        return self.model.critic_config.get_text_config().vocab_size

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.critic_config.get_text_config(), "max_position_embeddings", None)

    def layout_line(self) -> str:
        return f"processes: {self.processes} ({self.config.engine.parallel.describe(self.processes)})"


def recorded_processes(run_dir: str) -> int | None:
    """The process count run_dir's latest launch recorded (LAUNCH_FILE), or None."""
    try:
        with open(os.path.join(run_dir, LAUNCH_FILE)) as f:
            return int(json.load(f)["processes"])
    except (FileNotFoundError, KeyError, ValueError, TypeError):
        return None


def record_processes(run_dir: str, processes: int) -> None:
    tmp = os.path.join(run_dir, f".{LAUNCH_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump({"processes": processes}, f)
        f.write("\n")
    os.replace(tmp, os.path.join(run_dir, LAUNCH_FILE))


def check_run(config: TrainConfig, *, in_use: bool = True) -> ResumePoint | None:
    """Read-only checks of trainer.run_dir (ValueError, nothing written): another run holds it
    (`in_use`: the rank that would take the lock asks); a fresh run finds checkpoints there; a
    resumed one lacks a complete checkpoint, the prepared rollouts or the run's config.yaml, or sets
    a key that cannot change mid-run. Returns the resume point (None for a fresh run)."""
    run_dir = os.path.abspath(config.trainer.run_dir)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    if in_use:  # named first: what a run in progress has written so far would be reported instead
        check_not_in_use(run_dir)
    latest = checkpoints.find_latest(ckpt_root)
    if not config.trainer.resume:
        if latest is not None:
            raise ValueError(f"{run_dir} already holds checkpoints ({os.path.basename(latest)}); pass --resume to "
                             f"continue that run, or choose another trainer.run_dir")
        return None
    if latest is None:
        raise ValueError(f"--resume: no complete checkpoint in {ckpt_root}; run without --resume to start fresh")
    prepared = os.path.join(run_dir, PREPARED)
    if not os.path.isfile(prepared):
        raise ValueError(f"--resume: {prepared} is missing, so the run's old values and returns cannot be "
                         f"restored; resume in the run_dir the checkpoint came from")
    saved_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(saved_file):
        raise ValueError(f"--resume: {saved_file} is missing, so the run's settings cannot be checked; resume in the "
                         f"run_dir the checkpoint came from")
    saved = load_train_config([saved_file], [])
    changes = config_changes(saved, config)
    if config.engine.optim.total_steps is None:  # the saved value is what this run resolved it to
        changes = [c for c in changes if c[0] != "engine.optim.total_steps"]
    if config.engine.mixed_precision == "auto":  # resolved where the ranks' device is known (the trainer)
        changes = [c for c in changes if c[0] != "engine.mixed_precision"]
    fixed = [c for c in changes if c[0] not in CHANGEABLE_ON_RESUME]
    if fixed:
        listed = "; ".join(f"{key}: {old!r} in the run, {new!r} now" for key, old, new in fixed)
        raise ValueError(f"--resume: settings that cannot change mid-run differ from {saved_file}: {listed}. Resume "
                         f"with the run's values, or start a new run in another trainer.run_dir")
    reported = tuple(c for c in changes if c[0] not in ("trainer.resume", "trainer.run_dir"))
    return ResumePoint(latest, saved, reported, recorded_processes(run_dir))


def plan_job(config: TrainConfig, processes: int | None = None, *, in_use: bool = True) -> JobPlan:
    """The job's plan for `processes` engine ranks (None: the resumed run's count, else the layout's
    minimum); ValueError for anything the job would refuse, before anything starts or is written."""
    resume = check_run(config, in_use=in_use)
    note = ""
    if processes is None:
        if resume is not None and resume.processes is not None:
            processes = resume.processes
            note = "as the run last ran (--nproc N to change)"
        else:
            processes = config.engine.parallel.min_world_size
            if resume is not None:
                note = "the run records no process count: the layout's minimum (--nproc N to change)"
    elif resume is not None and resume.processes is not None and resume.processes != processes:
        note = f"the run last ran on {resume.processes}"
    if processes < 1:
        raise ValueError(f"--nproc {processes}: the process count must be >= 1")
    model = check_layout(config.backend, config.engine, processes)
    return JobPlan(config, processes, model, resume, note)
