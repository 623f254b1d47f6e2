"""The training job, for any backend: rollouts in, a trained critic (checkpoints + HF export) out.

  load and validate rollouts -> build the engine -> old values (and GAE returns) from the initial
  critic -> epochs of shuffled mini-batches, each rank taking its share -> held-out evaluation
  after every epoch -> checkpoints, metrics, plot, HF export.
Old values the rollouts did not bring are the current critic's predictions, renewed at the start
of every PPO iteration (data.rollout_batch_size rollouts of an epoch's order: the value clip is a
trust region around the critic that starts the iteration, not a cap around the initial one); old
values given in the data stay as given.
Resuming restores the engine and the data position; everything that was derived from the initial
critic is kept in run_dir/prepared_rollouts.pt and the current PPO iteration's old values in the
checkpoint, so a resumed run ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch

from ..storage import checkpoints
from ..storage.checkpoints import EXTRA_TENSORS
from ..engine.config import DataConfig, TrainConfig, TrainerConfig, precision_line, to_yaml
from ..learning.data import (Rollouts, gae, make_default_records, read_records, split_held_out, to_rollouts,
                             validate_records)
from ..learning.multi_turn import make_multi_turn_records
from ..parallel.batching import data_parallel_shares
from ..parallel.distributed import DistContext, all_gather_object, barrier, one_outcome, world_group
from ..engine import RolloutBatch, shift_to_tokens
from ..engine.registry import build_engine, resolved_for
from ..engine.optimizers import optimizer_line
from ..valuehead.multimodal import select
from ..learning.loss import explained_variance
from .metrics import MetricsLogger, plot_metrics
from .telemetry import Telemetry
from .plan import PREPARED, JobPlan, plan_job, record_processes
from .rollout_images import check_images, patches, refuse_images_for_text_critic, with_images_again
from .run_lock import run_dir_lock
from .vision_rollouts import make_vision_records, make_zeroed_vision_records

# A checkpoint's extra tensors: the PPO iteration's old values, response tokens only,
OLD_VALUES = "old_values"
RETURNS = "returns"  # ... and its returns, when the job renews them (truncated rows bootstrap from the critic)
VERSIONS = "old_values_versions"  # ... and the critic versions that computed those old values
EMBEDDED_ROLLOUTS = {"embedded:default": make_default_records, "embedded:multi_turn": make_multi_turn_records,
                     "embedded:vision": make_vision_records, "embedded:vision_zeroed": make_zeroed_vision_records}


class TrainingInterrupted(Exception):
    """Ctrl-C (SIGINT) during training: where it stopped, and the checkpoint to resume from."""

    def __init__(self, step: int, latest: str | None, *, finished: bool = False):
        super().__init__(f"interrupted at step {step}")
        self.step, self.latest, self.finished = step, latest, finished

    def message(self) -> str:
        if self.finished:
            return (f"interrupted after training had finished (step {self.step}): the final checkpoint {self.latest} "
                    f"is complete; only what comes after it (export, plot or final evaluation) may be missing")
        if self.latest is None:
            return f"interrupted at step {self.step}, before the first checkpoint; run again to start over"
        return f"interrupted at step {self.step}; resume with --resume (from {os.path.basename(self.latest)})"


def resolve_model_path(path: str, run_dir: str, dist: DistContext) -> str:
    """`embedded:<family>` -> a tiny random model written once into run_dir (by rank 0)."""
    if not path.startswith("embedded:"):
        return path
    from ..storage.atomic_dir import atomic_directory
    from ..testdata import save_tiny_causal_lm

    family = path.removeprefix("embedded:")
    target = os.path.join(run_dir, f"embedded-{family}")
    if dist.is_main and not os.path.isfile(os.path.join(target, "config.json")):
        with atomic_directory(target, overwrite=True) as staging:
            save_tiny_causal_lm(family, staging)
    barrier(world_group())
    return target


def read_rollouts(config: TrainConfig, vocab_size: int, max_positions: int | None = None,
                  say=print, *, critic_config=None) -> tuple[Rollouts, Rollouts]:
    """(train, eval) rollouts, validated; eval is data.eval_path or a held-out share of train.
    critic_config: the critic's, which rows with images are checked against (None: a text-only critic)."""
    data = config.data
    notes: list[str] = []
    limits = {"max_positions": max_positions, "truncate": data.truncate_to_max_positions,
              "off_mask_rewards": data.off_mask_rewards, "timestep_unit": data.timestep_unit}

    def checked(records: list, source: str) -> Rollouts:
        refuse_images_for_text_critic(records, critic_config, source, config.engine.model.path)
        notes.extend(validate_records(records, vocab_size, source, **limits))
        rollouts = to_rollouts(records)
        check_images(rollouts, critic_config, source, ulysses_degree=config.engine.parallel.ulysses)
        return rollouts

    if data.train_path in EMBEDDED_ROLLOUTS:
        rollouts = checked(EMBEDDED_ROLLOUTS[data.train_path](data.num_rollouts, seed=config.engine.seed),
                           data.train_path)
    elif data.train_path.startswith("embedded:"):
        raise ValueError(f"data.train_path={data.train_path}: the embedded rollout sets are "
                         f"{', '.join(EMBEDDED_ROLLOUTS)}; or give a .parquet / .jsonl file (docs/DATA.md)")
    else:
        rollouts = checked(read_records(data.train_path), data.train_path)
    if data.eval_path is not None:
        train, held_out = rollouts, checked(read_records(data.eval_path), data.eval_path)
    else:
        train, held_out = split_held_out(rollouts, data, seed=config.engine.seed)
    for note in notes:
        say(note)
    return train, held_out


def _distributed_values(engine, rollouts: Rollouts, dist: DistContext) -> torch.Tensor:
    """Critic values [N, T] for all rollouts on every rank: each data-parallel rank computes its
    token-balanced share (maybe none; its model-parallel peers compute the same share with it), then
    the DP group gathers."""
    mine = data_parallel_shares(rollouts.attention_mask, engine.dp_size, patches(rollouts))[engine.dp_rank]
    values = engine.compute_values(rollouts.input_ids[mine], rollouts.attention_mask[mine],
                                   select(rollouts.multi_modal_inputs, mine))
    out = torch.zeros(rollouts.input_ids.shape, dtype=torch.float32)
    for index, share in all_gather_object((mine, values), group=engine.dp_group):
        out[index] = share
    return out


def critic_returns(rollouts: Rollouts, values: torch.Tensor, config: TrainConfig) -> torch.Tensor:
    """GAE(data.gamma, data.lam_critic) returns of rollouts that bring rewards, in data.timestep_unit,
    rewards off the response placed by data.off_mask_rewards. `values` are the critic's now
    (unshifted [N, T]): GAE's values are the rollouts' old values when they brought them, else these;
    a truncated row bootstraps from its entry at the row's last token (the state after it)."""
    data = config.data
    predictions = shift_to_tokens(values) * rollouts.response_mask
    bootstrap = None
    if rollouts.truncated is not None:
        last = (rollouts.attention_mask.sum(dim=1) - 1).clamp(min=0)
        bootstrap = values[torch.arange(len(rollouts)), last]
    return gae(rollouts.rewards, rollouts.old_values if rollouts.brought_old_values else predictions,
               rollouts.response_mask, data.gamma, data.lam_critic, turn_ids=rollouts.turn_ids,
               timestep_unit=data.timestep_unit, truncated=rollouts.truncated, bootstrap_values=bootstrap,
               off_mask_rewards=data.off_mask_rewards)[1]


def prepare_targets(engine, rollouts: Rollouts, config: TrainConfig, dist: DistContext) -> Rollouts:
    """Fill in old values (the initial critic's predictions; renew_targets renews them every PPO
    iteration) and returns (critic_returns with the initial critic's values when given rewards)."""
    if rollouts.old_values is None or rollouts.returns is None:
        values = _distributed_values(engine, rollouts, dist)
        predictions = shift_to_tokens(values)
        check_model_values(predictions, rollouts.response_mask, config, "the initial critic's values")
        if rollouts.old_values is None:
            rollouts.old_values = predictions * rollouts.response_mask
            rollouts.versions = torch.full((len(rollouts),), engine.version, dtype=torch.long)
        if rollouts.returns is None:
            rollouts.returns = critic_returns(rollouts, values, config)
    return rollouts


def renew_targets(engine, rollouts: Rollouts, rows: torch.Tensor, config: TrainConfig, dist: DistContext,
                  step: int, *, old_values: bool, returns: bool) -> None:
    """A PPO iteration's targets for `rows` from the current critic: its predictions as old values
    (for rollouts that brought none; see data.rollout_batch_size), and the returns (renews_returns)."""
    part = rollouts.select(rows)
    values = _distributed_values(engine, part, dist)
    predictions = shift_to_tokens(values)
    check_model_values(predictions, part.response_mask, config, f"the critic's values after step {step}")
    width = predictions.shape[1]  # select() trims the padding
    if old_values:
        rollouts.old_values[rows, :width] = predictions * part.response_mask
        rollouts.versions[rows] = engine.version
        part = rollouts.select(rows)
    if returns:
        rollouts.returns[rows, :width] = critic_returns(part, values, config)


def evaluate(engine, rollouts: Rollouts, config: TrainConfig, dist: DistContext) -> dict[str, float]:
    """Held-out value loss (unclipped, token-mean 0.5 * squared error; `mse` is the same number, the
    name the train rows use for it) and explained variance of the current critic, over the tokens it
    regresses (the value mask's, else the response's). Returns the job renews are the current
    critic's here too (a truncated row's bootstrap)."""
    return _scores(rollouts, *_held_out_values(engine, rollouts, config, dist))


def _held_out_values(engine, rollouts: Rollouts, config: TrainConfig, dist: DistContext
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the current critic's predictions for each token [N, T], the returns they are scored against)."""
    values = _distributed_values(engine, rollouts, dist)
    predictions = shift_to_tokens(values)
    check_model_values(predictions, rollouts.response_mask, config, "the critic's held-out values")
    returns = critic_returns(rollouts, values, config) if renews_returns(config, rollouts) else rollouts.returns
    return predictions, returns


def _scores(rollouts: Rollouts, predictions: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
    mask = rollouts.loss_mask.bool()
    error = (predictions - returns)[mask]
    mse = float(0.5 * (error ** 2).mean()) if error.numel() else float("nan")
    return {
        "value_loss": mse,
        "mse": mse,
        "explained_variance": explained_variance(predictions, returns, rollouts.loss_mask),
    }


def check_model_values(predictions: torch.Tensor, response_mask: torch.Tensor, config: TrainConfig, what: str) -> None:
    """The model, not the (already validated) rollouts, is to blame for non-finite values it computes."""
    bad = int((~torch.isfinite(predictions[response_mask.bool()])).sum())
    if bad:
        raise ValueError(f"{what} are NaN/inf at {bad} response tokens: the model ({config.engine.model.path}) "
                         f"produces them, not the rollout data (which was checked). Check its weights (python -m "
                         f"{__package__.removesuffix('.job')}.valuehead inspect), or engine.model.dtype / engine.mixed_precision")


def _sequence_split_note(parallel) -> str:
    """', each sequence split over N ranks (ulysses N)' when the layout splits sequences, else ''."""
    degrees = {name: getattr(parallel, name) for name in ("context", "ulysses")}
    split = degrees["context"] * degrees["ulysses"]
    if split == 1:
        return ""
    named = ", ".join(f"{name} {degree}" for name, degree in degrees.items() if degree > 1)
    return f", each sequence split over {split} ranks ({named})"


def _batch(rollouts: Rollouts, index: torch.Tensor) -> RolloutBatch:
    part = rollouts.select(index)
    return RolloutBatch(part.input_ids, part.attention_mask, part.response_mask, part.old_values, part.returns,
                        value_mask=part.value_mask, multi_modal_inputs=part.multi_modal_inputs)


def run_training(config: TrainConfig, dist: DistContext, *, say=None, engine_builder=None,
                 world_size: int | None = None, device_type: str | None = None) -> dict[str, float]:
    """The training job. SPMD under torchrun: every rank runs this with its own `dist` and engine.
    Driven from one process instead (integrations/ray: a RayCriticGroup), `dist` is that process's
    world of one and `engine_builder(engine_config)` returns the engine it drives (the group, which
    looks like one data-parallel rank holding every row); `world_size` is then the group's size,
    for the layout checks, and `device_type` the engine ranks' device (default: dist's), which
    engine.mixed_precision=auto resolves for."""
    requested = config.engine.mixed_precision
    device_type = device_type or dist.device.type
    config = resolved_config(config, device_type)
    trainer = config.trainer
    world_size = world_size or dist.world_size
    run_dir = os.path.abspath(trainer.run_dir)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    main = dist.is_main
    if say is None:
        from tqdm import tqdm

        say = tqdm.write  # prints above the progress bar instead of through it
    say = say if main else (lambda *a, **k: None)
    say(precision_line(requested, config.engine.mixed_precision, device_type))
    # The job's plan, read-only (a refused run changes nothing in run_dir), by the functions the
    # launcher planned it with: the layout and the backend's refusals, the checkpoint read once, the
    # run directory (a run in progress there named first). Every rank makes it and all agree on the
    # outcome: a rank refused alone would leave the others waiting for it in the engine's first collective.
    with one_outcome("checking the run", group=world_group(), timeout_s=config.engine.collective_timeout_s):
        plan = plan_job(config, world_size, in_use=main)
        resuming = plan.resume is not None
        if resuming:
            say_resume(plan, say)
            train, held_out, refresh = resumed_rollouts(plan)
        else:
            train, held_out = read_rollouts(config, plan.vocab_size, plan.max_positions, say,
                                            critic_config=plan.model.critic_config)
            refresh = renewal(config, train)
    latest = plan.resume.latest if resuming else None
    saved = plan.resume.saved if resuming else None

    # One run per run_dir (rank 0 holds the lock; if it cannot, it fails and takes the others down).
    with run_dir_lock(run_dir) if main else contextlib.nullcontext():
        if main:
            os.makedirs(ckpt_root, exist_ok=True)
            checkpoints.prune(ckpt_root, keep_last=trainer.keep_last)  # staging left by an interrupted save
        model_path = resolve_model_path(config.engine.model.path, run_dir, dist)
        mini = config.data.mini_batch_size
        steps_per_epoch = math.ceil(len(train) / mini)
        # The LR schedule spans the steps the run was started with: a resumed run that adds epochs keeps
        # its schedule (saved in config.yaml) rather than stretching it mid-run.
        total_steps = config.engine.optim.total_steps or steps_per_epoch * trainer.epochs
        if saved is not None and config.engine.optim.total_steps is None:
            total_steps = saved.engine.optim.total_steps or total_steps
        optim = dataclasses.replace(config.engine.optim, total_steps=total_steps)
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, optim=optim))
        if main:
            # config.yaml tells the truth: the keys this run uses, with the schedule's length filled in;
            # launch.json the process count, which a --resume without --nproc keeps.
            with open(os.path.join(run_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(config))
            record_processes(run_dir, world_size)
        model_cfg = dataclasses.replace(config.engine.model, path=model_path)
        engine_cfg = dataclasses.replace(config.engine, model=model_cfg)

        engine = engine_builder(engine_cfg) if engine_builder else build_engine(config.backend, engine_cfg, dist)
        try:
            return _train(engine, config, dist, train, held_out, latest, resuming, say, steps_per_epoch,
                          refresh=refresh, critic_config=plan.model.critic_config)
        finally:
            engine.close()


FEW_STEPS, SUGGESTED_STEPS = 100, 250
"""Fewer optimizer steps than FEW_STEPS, and the job says so, suggesting settings that take about
SUGGESTED_STEPS: the default job takes 116 on its 2048 rollouts and learns (held-out EV > 0.9); 300
agent trajectories at the defaults took 20 and learned nothing (EV 0.03), where 15 epochs of
mini-batches of 16 (255 steps) reached 0.78 (on 300 of the embedded rollouts: 0.73 at 20 steps, 0.81
at 255)."""


def too_few_steps(train_rows: int, config: TrainConfig) -> str | None:
    """A warning naming the keys to change when the job would take fewer than FEW_STEPS optimizer steps
    at the default epochs and mini-batch size (a small data set; a user who set either chose the
    run's length), with values that take about SUGGESTED_STEPS."""
    mini, epochs = config.data.mini_batch_size, config.trainer.epochs
    chosen = mini != DataConfig().mini_batch_size or epochs != TrainerConfig().epochs
    per_epoch = math.ceil(train_rows / mini)
    steps = per_epoch * epochs
    if chosen or steps >= FEW_STEPS:
        return None
    smaller = max(1, min(mini, 16))
    more_epochs = math.ceil(SUGGESTED_STEPS / math.ceil(train_rows / smaller))
    return (f"warning: only {steps} optimizer steps ({train_rows} train rollouts / data.mini_batch_size={mini} = "
            f"{per_epoch} per epoch, x trainer.epochs={epochs}): a critic needs a few hundred to learn; for this "
            f"data set use e.g. data.mini_batch_size={smaller} trainer.epochs={more_epochs}")


def resolved_config(config: TrainConfig, device_type: str) -> TrainConfig:
    """The job's config with engine.mixed_precision=auto resolved for the engine ranks' device (what
    config.yaml records, and a resume compares against)."""
    return dataclasses.replace(config, engine=resolved_for(config.backend, config.engine, device_type))


def say_resume(plan: JobPlan, say) -> None:
    """What a resume continues: the process count when it differs from the run's, the keys that changed."""
    if plan.processes_note:
        say(f"resume: {plan.processes} process(es), {plan.processes_note}")
    for line in plan.resume.lines():
        say(line)


@dataclasses.dataclass(frozen=True, slots=True)
class Renewal:
    """What the job takes from the current critic at the start of every PPO iteration
    (data.rollout_batch_size rollouts of an epoch's order)."""

    old_values: bool = False
    """Old values: they centre the value clip (not without one, nor when the rollouts bring their own)."""
    returns: bool = False
    """Returns (renews_returns)."""

    def __bool__(self) -> bool:
        return self.old_values or self.returns


def renews_returns(config: TrainConfig, rollouts: Rollouts) -> bool:
    """Whether the returns of these rollouts move with the critic: they bring rewards, and a truncated
    row bootstraps from the critic, or data.lam_critic < 1 weighs the critic's values (unless the
    rollouts brought the old values GAE uses)."""
    if rollouts.rewards is None:
        return False
    truncated = rollouts.truncated is not None and bool(rollouts.truncated.any())
    return truncated or (config.data.lam_critic < 1 and not rollouts.brought_old_values)


def renewal(config: TrainConfig, train: Rollouts) -> Renewal:
    """What the job renews every PPO iteration for these (not yet prepared) rollouts; when anything,
    data.rollout_batch_size must be a multiple of data.mini_batch_size (ValueError naming the
    nearest that are)."""
    renew = Renewal(old_values=train.old_values is None and config.engine.loss.clip_range is not None,
                    returns=renews_returns(config, train))
    batch, mini = config.data.iteration_rollouts, config.data.mini_batch_size
    if renew and batch is not None and batch % mini:
        below, above = batch // mini * mini, (batch // mini + 1) * mini
        nearest = f"{below} or {above}" if below else f"{above}"
        what = " and ".join(name for name, on in (("old values", renew.old_values), ("returns", renew.returns)) if on)
        raise ValueError(f"data.rollout_batch_size={batch} must be a multiple of data.mini_batch_size={mini} (the "
                         f"mini-batches of one PPO iteration, whose {what} the critic renews): use {nearest}, "
                         f"leave it unset (4 x data.mini_batch_size), or null for one iteration per epoch")
    return renew


def _train(engine, config: TrainConfig, dist: DistContext, train: Rollouts, held_out: Rollouts,
           latest: str | None, resuming: bool, say, steps_per_epoch: int, *, refresh: Renewal,
           critic_config) -> dict[str, float]:
    trainer = config.trainer
    main = dist.is_main
    run_dir = os.path.abspath(trainer.run_dir)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    prepared_file = os.path.join(run_dir, PREPARED)
    mini = config.data.mini_batch_size
    total_steps = steps_per_epoch * trainer.epochs
    say(str(engine.load_report))
    trainable, total = engine.parameter_counts()
    say(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")
    say(optimizer_line(config.engine.optim, getattr(engine, "optimizer", None)))
    if config.engine.lora.rank:
        say(lora_line(config.engine.lora))
    exports = (", hf_export/" + (", hf_export_adapter/" if config.engine.lora.rank else "")) if trainer.export_hf else ""
    say(f"run dir: {run_dir} (metrics.jsonl{', tensorboard/' if trainer.tensorboard else ''}, checkpoints/"
        f"{exports}{', training.png' if trainer.plot else ''})")
    say(f"rollouts: {len(train)} train, {len(held_out)} held out; {steps_per_epoch} steps/epoch x "
        f"{trainer.epochs} epochs, mini-batch {mini} sequences over "
        f"{engine.data_parallel_ranks} data-parallel rank(s){_sequence_split_note(config.engine.parallel)}")

    note = too_few_steps(len(train), config)
    if note:
        say(note)
    optim = config.engine.optim
    if optim.warmup >= optim.total_steps:
        say(f"warning: the warm-up ({optim.warmup} steps) is as long as the run's {optim.total_steps} steps, so the lr "
            f"never reaches engine.optim.lr={optim.lr:g}: lower engine.optim.warmup_steps, or use "
            f"engine.optim.warmup_ratio")
    position = {"epoch": 0, "step_in_epoch": 0, "global_step": 0}
    if resuming:
        position = engine.load_checkpoint(latest)
        say(f"resumed from {latest} at epoch {position['epoch']}, step {position['global_step']}")
    else:
        train = prepare_targets(engine, train, config, dist)
        held_out = prepare_targets(engine, held_out, config, dist)
        if main:
            tmp = prepared_file + ".tmp"
            torch.save({"train": _as_dict(train), "eval": _as_dict(held_out), "refresh_old_values": refresh.old_values,
                        "renew_returns": refresh.returns,
                        "images": train.multi_modal_inputs is not None or held_out.multi_modal_inputs is not None}, tmp)
            os.replace(tmp, prepared_file)
        barrier(world_group())

    # A fresh run starts its metrics afresh; a resumed one drops what the interrupted run logged after
    # its last checkpoint (those steps run again).
    metrics_log = MetricsLogger(run_dir, enabled=main, tensorboard=trainer.tensorboard,
                                keep_until_step=position["global_step"] if resuming else None)
    if not resuming:
        metrics_log.log(0, evaluate(engine, held_out, config, dist), prefix="eval")
    progress = _progress(total_steps, position["global_step"], enabled=main and trainer.progress)
    step = position["global_step"]
    try:
        step = _epochs(engine, config, dist, train, held_out, position, metrics_log, progress, say, steps_per_epoch,
                       refresh=refresh, critic_config=critic_config)
        _save(engine, ckpt_root, step, {"epoch": trainer.epochs, "step_in_epoch": 0, "global_step": step},
              trainer.keep_last, main, say)
    except KeyboardInterrupt:
        progress.close()
        raise TrainingInterrupted(metrics_log.last_step, checkpoints.find_latest(ckpt_root)) from None
    progress.close()
    try:
        return _finish(engine, config, dist, held_out, metrics_log, run_dir, say)
    except KeyboardInterrupt:
        raise TrainingInterrupted(step, checkpoints.find_latest(ckpt_root), finished=True) from None


def _finish(engine, config: TrainConfig, dist: DistContext, held_out: Rollouts, metrics_log: MetricsLogger,
            run_dir: str, say) -> dict[str, float]:
    """After the final checkpoint: the HF export, the plot, the final evaluation and where it all went."""
    trainer = config.trainer
    if trainer.export_hf:
        export_dir = os.path.join(run_dir, "hf_export")
        engine.export_hf(export_dir, max_shard_size=trainer.export_max_shard_size)
        if config.engine.loss.support is None:
            say(f"exported {export_dir} (load it with transformers.AutoModelForTokenClassification)")
        else:  # plain transformers would give its bin logits
            say(f"exported {export_dir} (an HL-Gauss critic: load it with common.valuehead.load_critic for its values)")
        if config.engine.lora.rank:
            adapter_dir = os.path.join(run_dir, "hf_export_adapter")
            engine.export_adapter(adapter_dir)
            say(f"exported {adapter_dir} (the LoRA adapter and the head: peft.PeftModel.from_pretrained onto the "
                f"base model, {engine.config.model.path})")
    metrics_log.close()
    say(f"metrics: {metrics_log.path}" + (f", TensorBoard logs: {os.path.join(run_dir, 'tensorboard')}"
                                          if trainer.tensorboard else ""))
    if dist.is_main and trainer.plot:
        say(f"plot: {plot_metrics(metrics_log.path, os.path.join(run_dir, 'training.png'))}")
    predictions, returns = _held_out_values(engine, held_out, config, dist)
    final = _scores(held_out, predictions, returns)
    say(_sample_line(held_out, predictions, returns))
    say(f"final explained_variance={final['explained_variance']:.4f}")
    return final


def _epochs(engine, config: TrainConfig, dist: DistContext, train: Rollouts, held_out: Rollouts, position: dict,
            metrics_log: MetricsLogger, progress, say, steps_per_epoch: int, *, refresh: Renewal, critic_config) -> int:
    """The training loop from `position` to the last epoch; returns the last global step. `refresh`:
    what each PPO iteration starts by taking from the current critic (old values the rollouts did not
    bring, returns that move with it)."""
    trainer = config.trainer
    main = dist.is_main
    ckpt_root = os.path.join(os.path.abspath(trainer.run_dir), "checkpoints")
    mini = config.data.mini_batch_size
    total_steps = steps_per_epoch * trainer.epochs
    step = position["global_step"]
    batch = config.data.iteration_rollouts
    per_iteration = steps_per_epoch if batch is None else batch // mini  # mini-batches of one PPO iteration
    telemetry = Telemetry(engine, critic_config, dist.device)
    for epoch in range(position["epoch"], trainer.epochs):
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(config.engine.seed * 1000 + epoch))
        first = position["step_in_epoch"] if epoch == position["epoch"] else 0
        if refresh and first % per_iteration:  # resumed inside an iteration: its targets came with the checkpoint
            _restore_targets(train, _iteration_rows(order, first, per_iteration, mini), position, refresh)
        for step_in_epoch in range(first, steps_per_epoch):
            rows = order[step_in_epoch * mini:(step_in_epoch + 1) * mini]
            if refresh and step_in_epoch % per_iteration == 0 and step > 0:  # step 0's: prepare_targets
                with telemetry.compute_values():
                    renew_targets(engine, train, _iteration_rows(order, step_in_epoch, per_iteration, mini),
                                  config, dist, step, old_values=refresh.old_values, returns=refresh.returns)
            share = data_parallel_shares(train.attention_mask[rows], engine.dp_size,
                                         patches(train, rows))[engine.dp_rank]
            with telemetry.update(train.attention_mask[rows].sum(1)) as measured:
                metrics = engine.update(_batch(train, rows[share]))  # a DP rank's share, balanced by tokens
            metrics.update(measured)
            if train.versions is not None:  # critic steps since the old values were computed
                staleness = (engine.version - 1 - train.versions[rows]).double()  # the version that took the step
                metrics.update({"old_values/staleness_mean": float(staleness.mean()),
                                "old_values/staleness_max": float(staleness.max())})
            step += 1
            if not math.isfinite(metrics["value_loss"]):
                # The rollouts were checked finite: the critic's own values have blown up.
                raise ValueError(f"step {step}: the value loss is {metrics['value_loss']}: the critic's values became "
                                 f"NaN/inf in training (the rollout data was checked finite); lower "
                                 f"engine.optim.lr, or resume from an earlier checkpoint with a smaller one")
            metrics_log.log(step, metrics, epoch=epoch + 1)
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['value_loss']:.4f}", ev=f"{metrics['explained_variance']:.3f}",
                                 refresh=False)
            next_position = {"epoch": epoch, "step_in_epoch": step_in_epoch + 1, "global_step": step}
            if step_in_epoch + 1 == steps_per_epoch:
                next_position = {"epoch": epoch + 1, "step_in_epoch": 0, "global_step": step}
            if trainer.save_every_steps and step % trainer.save_every_steps == 0 and step != total_steps:
                tensors = {}
                if refresh and next_position["step_in_epoch"] % per_iteration:  # the iteration goes on with these
                    iteration = _iteration_rows(order, next_position["step_in_epoch"], per_iteration, mini)
                    response = train.response_mask[iteration].bool()
                    if refresh.old_values:
                        tensors[OLD_VALUES] = train.old_values[iteration][response]
                        tensors[VERSIONS] = train.versions[iteration]
                    if refresh.returns:
                        tensors[RETURNS] = train.returns[iteration][response]
                _save(engine, ckpt_root, step, next_position, trainer.keep_last, main, say, tensors)
        held = evaluate(engine, held_out, config, dist)
        metrics_log.log(step, held, prefix="eval", epoch=epoch + 1)
        # Like with like: with HL-Gauss the train loss is a cross-entropy, the held-out loss an MSE.
        if config.engine.loss.support is None:
            losses = f"train loss {metrics['value_loss']:.4f}, held-out loss {held['value_loss']:.4f}"
        else:
            losses = (f"train cross-entropy {metrics['value_loss']:.4f}, train mse {metrics['mse']:.4f}, "
                      f"held-out mse {held['value_loss']:.4f}")
        say(f"epoch {epoch + 1}/{trainer.epochs}: {losses}, held-out explained_variance {held['explained_variance']:.3f}")
    return step


def _iteration_rows(order: torch.Tensor, step_in_epoch: int, per_iteration: int, mini: int) -> torch.Tensor:
    """The rows of the PPO iteration that holds the epoch's step `step_in_epoch` (0-based)."""
    start = step_in_epoch // per_iteration * per_iteration
    return order[start * mini:(start + per_iteration) * mini]


def _restore_targets(train: Rollouts, rows: torch.Tensor, position: dict, renewed: Renewal) -> None:
    """The renewed targets of the PPO iteration a checkpoint stopped in, back into `train`."""
    mask = train.response_mask[rows].bool()
    # The checkpoint's extra tensors (a run from before them: its extra state).
    tensors = position.get(EXTRA_TENSORS) or position
    for key, on in ((OLD_VALUES, renewed.old_values), (RETURNS, renewed.returns)):
        if not on:
            continue
        saved = tensors.get(key)
        if saved is None or saved.numel() != int(mask.sum()):
            raise ValueError(f"--resume: the checkpoint lacks the {key.replace('_', ' ')} of the PPO iteration it "
                             f"stopped in (or they do not fit {PREPARED}); resume from a checkpoint of this run")
        target = getattr(train, key)
        part = target[rows]
        part[mask] = saved.to(target.dtype)
        target[rows] = part
    if renewed.old_values and tensors.get(VERSIONS) is not None:  # a checkpoint from before versions: keep them
        train.versions[rows] = tensors[VERSIONS]


def lora_line(lora) -> str:
    return (f"LoRA rank {lora.rank} on {', '.join(lora.target_modules)} (alpha {lora.alpha:g}): the adapters and the "
            f"head train, the backbone is frozen")


def _sample_line(rollouts: Rollouts, predictions: torch.Tensor, returns: torch.Tensor) -> str:
    """The trained critic's values next to the returns for the first response tokens of held-out rollout 0
    (from the final evaluation's values: a one-row call would leave data-parallel ranks without rows)."""
    tokens = rollouts.loss_mask[0].bool().nonzero().flatten()[:8]
    values = [round(v, 3) for v in predictions[0, tokens].tolist()]
    targets = [round(r, 3) for r in returns[0, tokens].tolist()]
    return f"held-out rollout 0, first response tokens: values {values} vs returns {targets}"


def _save(engine, root: str, step: int, position: dict, keep_last: int, main: bool, say,
          tensors: dict | None = None) -> None:
    """A checkpoint of the engine with the data position, and the PPO iteration's renewed targets
    (`tensors`) as its extra tensors."""
    directory = checkpoints.step_dir(root, step)
    checkpoints.save_with_space_check(engine, root, directory, position, main=main, group=world_group(),
                                      extra_tensors=tensors)
    if main:
        checkpoints.mark_latest(root, directory)
        checkpoints.prune(root, keep_last=keep_last)
    barrier(world_group())
    say(f"checkpoint saved: {directory}")


def _as_dict(rollouts: Rollouts) -> dict:
    """The prepared rollouts' tensors; their images stay in the data (a resume reads them again)."""
    return {f.name: getattr(rollouts, f.name) for f in dataclasses.fields(rollouts) if f.name != "multi_modal_inputs"}


def _progress(total: int, done: int, *, enabled: bool):
    from tqdm import tqdm

    # disable=None: tqdm draws only on a terminal (logs get the per-epoch lines instead).
    return tqdm(total=total, initial=done, disable=True if not enabled else None, desc="critic", unit="step",
                mininterval=1.0, dynamic_ncols=True)


def resumed_rollouts(plan: JobPlan) -> tuple[Rollouts, Rollouts, Renewal]:
    """(train, held-out, renewal) of the run the plan resumes: the prepared rollouts (their old values and
    returns as the run left them), with their images read again from the data, which must still hold the
    run's rows (with_images_again: ValueError otherwise). The resume and its dry run both read them here."""
    config = plan.config
    where = os.path.join(os.path.abspath(config.trainer.run_dir), PREPARED)
    prepared = torch.load(where, weights_only=True)
    train, held_out = Rollouts(**prepared["train"]), Rollouts(**prepared["eval"])
    # False: a run from before the renewal
    refresh = Renewal(bool(prepared.get("refresh_old_values", False)), bool(prepared.get("renew_returns", False)))
    if prepared.get("images"):  # data, not state: read again from the data
        data_train, data_eval = read_rollouts(config, plan.vocab_size, plan.max_positions, lambda *_: None,
                                              critic_config=plan.model.critic_config)
        train = with_images_again(train, data_train, config.data.train_path, where)
        held_out = with_images_again(held_out, data_eval, config.data.eval_path or config.data.train_path, where)
    return train, held_out, refresh


def dry_run(plan: JobPlan, *, say=print, memory: str | None = None) -> None:
    """What the job would do, from its plan (every check a launch makes before it starts a process
    has passed), and the rollouts it would train on, checked; builds no engine, trains and writes
    nothing."""
    config = plan.config
    say(f"{plan.layout_line()}{f', {plan.processes_note}' if plan.processes_note else ''}; the dry run itself runs "
        f"in this one process")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what the launch's workers on this machine take
    say(precision_line(config.engine.mixed_precision, resolved_config(config, device).engine.mixed_precision, device))
    if memory is not None:  # the launcher's `memory per rank:` line (common.engine.memory)
        say(memory)
    if plan.resume is not None:
        resume = plan.resume
        say(f"resume: from {resume.latest} (the critic, its optimizer and the data position come from the "
            f"checkpoint; the rollouts and their old values from {PREPARED})")
        for line in resume.lines():
            say(line)
    else:
        say(f"model: {model_line(config.engine.model.path, plan)}")
    if config.engine.lora.rank:
        say(lora_line(config.engine.lora))
    if plan.resume is not None:
        train, held_out, _ = resumed_rollouts(plan)
    else:
        train, held_out = read_rollouts(config, plan.vocab_size, plan.max_positions, say,
                                        critic_config=plan.model.critic_config)
        renewal(config, train)
    tokens = int(train.attention_mask.sum())
    note = too_few_steps(len(train), config)
    if note:
        say(note)
    say(f"rollouts: {len(train)} train ({tokens} tokens), {len(held_out)} held out; config OK")


def model_line(path: str, plan: JobPlan) -> str:
    """'<path>: <format>, <family> -> <critic class>, initialise <...>' from the plan's one read."""
    from ..valuehead.cli import inspect_checkpoint, would_initialise
    from ..valuehead.config import critic_class, head_name

    critic_config = plan.model.critic_config
    if plan.model.plan is None:  # embedded:<family>: a fresh random causal LM
        what = f"causal-lm (a tiny random {path.removeprefix('embedded:')}, made when the run starts)"
        initialise = would_initialise(head_name(critic_config))
    else:
        info = inspect_checkpoint(path, plan=plan.model.plan)
        what, initialise = info["format"], info["would_initialise"]
    return (f"{path}: {what}, {critic_config.model_type} -> {critic_class(critic_config).__name__}, "
            f"initialise {', '.join(initialise) or 'nothing'}")
