"""Checkpoints, for every backend: where they live, how they are written, what they belong to.

run_dir/checkpoints/step_000012/   a complete checkpoint (written atomically, see staged_checkpoint)
run_dir/checkpoints/latest         the name of the newest complete one (replaced atomically)
Staging directories of an interrupted save (".step_*.tmp-*") are never read and are cleaned up.

Each backend writes its own shards (DCP, megatron dist_checkpointing, ...) into the staging
directory, plus `trainer_state.pt` (save_trainer_state: LR schedule, the engine's RNG, the caller's
extra state); `critic_checkpoint.json`, written last, holds a fingerprint of the critic in Hugging
Face parameter names and shapes (and the transforms that rewrote it), which does not depend on the
parallel layout: a checkpoint resumes at another layout of the same backend, and a checkpoint of
another model is refused by name. The fsdp and veomni backends write the same DCP layout and read
each other's checkpoints; megatron's dist_checkpointing shards are its own (it refuses the others'
and they refuse its: move between them through hf_export).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from .atomic_dir import commit_staging_dir, make_staging_dir
from ..parallel.distributed import (agree_on_failure, all_gather_object, barrier, broadcast_object, gather_object,
                                    group_rank)
from ..learning.hl_gauss import HLGaussSupport, describe, support_of

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
LATEST = "latest"
# Every engine writes this file into a checkpoint, last: its presence marks a complete checkpoint.
META_FILE = "critic_checkpoint.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def complete_checkpoints(root: str, marker: str = META_FILE) -> list[str]:
    """Step directories that hold `marker` (the engine's last-written file), oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n) and os.path.isfile(os.path.join(root, n, marker)))
    return [os.path.join(root, n) for n in names]


def find_latest(root: str, marker: str = META_FILE) -> str | None:
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            candidate = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(candidate, marker)):
            return candidate
    found = complete_checkpoints(root, marker)
    return found[-1] if found else None


def mark_latest(root: str, directory: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(directory) + "\n")
    os.replace(tmp, os.path.join(root, LATEST))


def prune(root: str, keep_last: int, marker: str = META_FILE) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints, and leftover staging directories."""
    removed = complete_checkpoints(root, marker)[:-keep_last]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed + remove_staging_leftovers(root)


def remove_staging_leftovers(root: str) -> list[str]:
    """Delete the staging directories of interrupted saves (never read); complete checkpoints stay."""
    removed = [os.path.join(root, n) for n in os.listdir(root) if n.startswith(".step_") and ".tmp-" in n]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def hf_fingerprint(config, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> dict:
    """What a checkpoint must match to load into a critic: family, sizes, and every parameter's
    Hugging Face name and full (unsharded) shape."""
    shapes = sorted((name, [int(d) for d in shape]) for name, shape in named_shapes)
    text = config.get_text_config()
    fingerprint = {
        "model_type": config.model_type,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "num_parameters": sum(_numel(shape) for _, shape in shapes),
        "shapes_sha256": hashlib.sha256(json.dumps(shapes).encode()).hexdigest(),
    }
    support = support_of(config)
    if support is not None:  # absent for a scalar head, as in checkpoints from before HL-Gauss
        fingerprint["value_head"] = support.to_dict()
    return fingerprint


def critic_fingerprint(model, transforms: Iterable[str] = ()) -> dict:
    """hf_fingerprint of an HF-named critic module (full shapes: DTensor parameters report theirs),
    plus, when transforms rewrote it, their names and which parameters they left trainable."""
    params = list(model.named_parameters())
    fingerprint = hf_fingerprint(model.config, ((name, tuple(p.shape)) for name, p in params))
    transforms = list(transforms)
    if transforms:
        trainable = sorted(name for name, p in params if p.requires_grad)
        fingerprint["transforms"] = transforms
        fingerprint["trainable_sha256"] = hashlib.sha256(json.dumps(trainable).encode()).hexdigest()
    return fingerprint


TRAINER_STATE = "trainer_state.pt"


EXTRA_TENSORS = "extra_tensors"  # the key of load_checkpoint's result that holds the saved extra tensors


PER_RANK = "extra_tensors_per_rank"  # trainer_state.pt: {"world_size": N, "ranks": [{name: tensor}, ...]}


@dataclasses.dataclass(frozen=True, slots=True)
class ExtraTensors:
    """A save's extra tensors, as the writing rank holds them: those equal on every rank (once), and
    each rank's own where they differ (a replay buffer sharded over data-parallel ranks)."""

    shared: dict
    per_rank: list | None = None
    """[rank r's {name: tensor}] for the names that differ between ranks (None: no name does)."""


def _digest(tensor: torch.Tensor) -> tuple:
    data = tensor.contiguous().reshape(-1)  # on the CPU (gather_extra_tensors' copies)
    return tuple(tensor.shape), str(tensor.dtype), hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


def gather_extra_tensors(extra_tensors: dict | None, *, group, dst: int = 0) -> ExtraTensors | None:
    """The ranks' extra tensors for the writer (the rank of index `dst` in `group`, every rank of the
    engine; collective, before anything is written): a name whose tensor is the same on every rank is
    kept once, and each rank's own is kept where they differ: nothing is dropped. Ranks that pass
    different names are refused on every rank alike. None on the other ranks."""
    local = {name: tensor.detach().cpu() for name, tensor in (extra_tensors or {}).items()}
    digests = all_gather_object({name: _digest(t) for name, t in local.items()}, group=group)
    names = [sorted(d) for d in digests]
    if any(n != names[0] for n in names):
        listed = "; ".join(f"rank {r}: {n}" for r, n in enumerate(names))
        raise ValueError(f"save_checkpoint: every rank must pass the same extra_tensors names (each its own "
                         f"tensors); got {listed}")
    differ = sorted(name for name in names[0] if any(d[name] != digests[0][name] for d in digests))
    own = gather_object({name: local[name] for name in differ}, dst, group=group) if differ else None
    if group_rank(group) != dst:
        return None
    return ExtraTensors({name: t for name, t in local.items() if name not in differ}, own)


def save_trainer_state(staging: str, engine, extra_state: dict, extra_tensors: ExtraTensors | None = None) -> None:
    """The engine's LR schedule, own RNG and version (optimizer steps taken) plus the caller's extra
    state and extra tensors (gather_extra_tensors: a host's replay buffer, say, each rank's own kept)
    (the writer writes it)."""
    extra_tensors = extra_tensors or ExtraTensors({})
    state = {"scheduler": engine.scheduler.state_dict(), "rng": engine.generator.get_state(),
             "version": engine.version, "extra": extra_state, EXTRA_TENSORS: extra_tensors.shared}
    if extra_tensors.per_rank is not None:
        state[PER_RANK] = {"world_size": len(extra_tensors.per_rank), "ranks": extra_tensors.per_rank}
    torch.save(state, os.path.join(staging, TRAINER_STATE))


def extra_tensors_for(state: dict, rank: int, world_size: int, directory: str) -> dict:
    """This rank's extra tensors from a trainer state: those saved once, and its own of those each rank
    saved (the checkpoint's world size must be this one's then: ValueError naming them otherwise)."""
    tensors = dict(state.get(EXTRA_TENSORS) or {})
    per_rank = state.get(PER_RANK)
    if per_rank is not None:
        if per_rank["world_size"] != world_size:
            names = sorted(per_rank["ranks"][0])
            raise ValueError(f"{directory}: the extra tensors {names} were saved by each of {per_rank['world_size']} "
                             f"ranks (they differed between ranks), and this engine has {world_size}: load it on "
                             f"{per_rank['world_size']} ranks, or redistribute them yourself from "
                             f"{os.path.join(directory, TRAINER_STATE)}['{PER_RANK}']")
        tensors.update(per_rank["ranks"][rank])
    return tensors


def check_extra(extra_state: dict | None, extra_tensors: dict | None) -> None:
    """save_checkpoint's arguments, before anything is written: ValueError naming the problem."""
    if extra_state and EXTRA_TENSORS in extra_state:
        raise ValueError(f"save_checkpoint: extra_state may not hold the key {EXTRA_TENSORS!r}, which load_checkpoint "
                         f"uses for the extra tensors; pass tensors as extra_tensors")
    for name, tensor in (extra_tensors or {}).items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"save_checkpoint: extra_tensors must map names to tensors; got {name!r}: "
                             f"{type(tensor).__name__}")


def optimizer_kind(optim) -> dict:
    """What a checkpoint records of the optimizer whose state it holds (engine.optim)."""
    return {"name": optim.name, "state_dtype": optim.state_dtype}


def check_optimizer_kind(directory: str, meta: dict, optim) -> None:
    """ValueError unless the checkpoint holds the state of the optimizer engine.optim names (a
    checkpoint from before optimizers were recorded holds AdamW's, in float32). States do not convert:
    Muon keeps one buffer where AdamW keeps two moments, and bf16 moments are not fp32 ones."""
    written = meta.get("optimizer_kind", {"name": "adamw", "state_dtype": "float32"})
    wanted = optimizer_kind(optim)
    changed = [key for key in wanted if written.get(key) != wanted[key]]
    if changed:
        saved = " ".join(f"engine.optim.{key}={written.get(key)}" for key in changed)
        now = ", ".join(f"engine.optim.{key}={wanted[key]}" for key in changed)
        raise ValueError(f"{directory} holds the optimizer state of {saved}, and this engine has {now}: resume it "
                         f"with {saved}, or start a new run from its hf_export (the optimizer state does not convert)")


def load_trainer_state(directory: str, engine, *, rank: int = 0, world_size: int = 1) -> dict:
    """Restore what save_trainer_state wrote into `engine` (a checkpoint from before versions were saved
    resumes at its schedule's step count); returns the extra state, with the extra tensors of this
    rank (`rank` of `world_size`: extra_tensors_for), when any were saved, under "extra_tensors"."""
    state = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=True)
    tensors = extra_tensors_for(state, rank, world_size, directory)  # refused before anything is restored
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.generator.set_state(state["rng"])
    schedule = state["scheduler"]
    engine.version = int(state.get("version", schedule.get("last_epoch", schedule.get("step_count", 0))))
    extra = dict(state["extra"])
    if tensors:
        extra[EXTRA_TENSORS] = tensors
    return extra


def _numel(shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


@contextlib.contextmanager
def staged_checkpoint(directory: str, *, is_main: bool, group, timeout_s: float):
    """Yield one staging directory to every rank of `group`; it replaces `directory` when all ranks'
    blocks succeed. If any rank fails, every rank raises with that rank's message (none is left
    waiting: common.parallel.distributed.agree_on_failure, `timeout_s` at most), the staging directory is
    removed and the previous checkpoint stays as it was."""
    directory = os.path.abspath(directory)
    staging = error = None
    if is_main:
        try:
            staging = make_staging_dir(directory)
        except OSError as err:
            error = err
    staging = broadcast_object(staging, group=group)
    if staging is not None:
        try:
            yield staging
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if _interrupted(err):  # every rank got the signal: no collective, just leave
                if is_main:
                    shutil.rmtree(staging, ignore_errors=True)
                if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                    raise
                raise KeyboardInterrupt from err
            error = err  # reported to every rank below, then re-raised here
            # Said now, on this rank: a rank that failed inside a collective leaves the others in it.
            print(f"saving checkpoint {directory} failed on this rank: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
    try:
        agree_on_failure(error, f"saving checkpoint {directory} (the previous checkpoint is unchanged)",
                         group=group, timeout_s=timeout_s)
    except BaseException:
        if is_main and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if is_main:
        commit_staging_dir(staging, directory)
    barrier(group)  # the rename is done before any rank looks for the checkpoint


def _interrupted(err: BaseException) -> bool:
    """Ctrl-C or exit, also when DCP wrapped it into a CheckpointException mid-save."""
    if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return True
    if isinstance(err, CheckpointException):
        return any(isinstance(failure, (KeyboardInterrupt, SystemExit)) for failure, _ in err.failures.values())
    return False


def write_meta(staging: str, fingerprint: dict, **details) -> None:
    """The checkpoint's own description, written last: its presence marks a complete checkpoint."""
    with open(os.path.join(staging, META_FILE), "w") as f:
        json.dump({"fingerprint": fingerprint, **details}, f, indent=2)


def check_meta(directory: str, fingerprint: dict) -> dict:
    """Raise a clear ValueError unless `directory` is a complete checkpoint of this critic."""
    meta_file = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_file):
        raise ValueError(f"{directory} is not a critic-adapters checkpoint (no {META_FILE}); point at a "
                         f"checkpoints/step_* directory written by an engine")
    with open(meta_file) as f:
        meta = json.load(f)
    saved = meta["fingerprint"]
    if saved.get("value_head") != fingerprint.get("value_head"):
        held, wanted = (describe(None if f.get("value_head") is None else HLGaussSupport.from_dict(f["value_head"]))
                        for f in (saved, fingerprint))
        raise ValueError(f"checkpoint {directory} holds a critic with {held}, but this engine has {wanted}: resume it "
                         f"with the engine.loss.kind and engine.loss.hl_gauss settings it was trained with")
    if saved != fingerprint:
        diff = {k: (saved.get(k), v) for k, v in fingerprint.items() if saved.get(k) != v}
        raise ValueError(f"checkpoint {directory} belongs to another model: (checkpoint, this model) differ in {diff}; "
                         f"use the engine.model the checkpoint was trained with, or another run_dir")
    return meta


# -- the disk-full policy: check the space first, and name the disk when a save runs out of it ------
def _mount_point(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _disk_full_message(root: str, directory: str, needed: int, free: int) -> str:
    latest = find_latest(root)
    last_good = f"the last good checkpoint is {latest}" if latest else "there is no good checkpoint yet"
    return (f"not enough disk space to save {os.path.basename(directory)}: it needs about {needed / 2**20:.1f} MiB, "
            f"the disk at {_mount_point(root)} has {free / 2**20:.1f} MiB free; {last_good}. Free some space (or "
            f"lower trainer.keep_last), then resume with --resume")


def caused_by_full_disk(err: BaseException | None) -> bool:
    """Whether `err`, or an error it was raised from, is a full disk or quota (ENOSPC, EDQUOT)."""
    import errno

    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def save_with_space_check(engine, root: str, directory: str, extra_state: dict, *, main: bool, group,
                          extra_tensors: dict | None = None) -> None:
    """engine.save_checkpoint(directory, extra_state, extra_tensors) (collective), refused on every rank alike when
    the disk of `root` (the main rank's view) has less free space than the save needs; a save that
    fails on a full disk is a ValueError naming the disk, the sizes and the last good checkpoint."""
    # A write that runs out of space half-way fails with messages that never mention the disk.
    tensors = [*extra_state.values(), *(extra_tensors or {}).values()]
    needed = engine.checkpoint_bytes() + sum(value.numel() * value.element_size() for value in tensors
                                             if isinstance(value, torch.Tensor))
    free = broadcast_object(shutil.disk_usage(root).free if main else None, group=group)
    if needed > free:
        raise ValueError(_disk_full_message(root, directory, needed, free))
    try:
        # Only with tensors to save: a host's engine written before extra_tensors still saves the rest.
        engine.save_checkpoint(directory, extra_state, **({"extra_tensors": extra_tensors} if extra_tensors else {}))
    except Exception as err:
        free = shutil.disk_usage(root).free
        if free < needed or caused_by_full_disk(err):
            raise ValueError(_disk_full_message(root, directory, needed, free)) from err
        raise
