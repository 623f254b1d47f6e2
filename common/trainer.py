"""The training job, for any backend: rollouts in, a trained critic (checkpoints + HF export) out.

  load and validate rollouts -> build the engine -> old values (and GAE returns) from the initial
  critic -> epochs of shuffled mini-batches, each rank taking its share -> held-out evaluation
  after every epoch -> checkpoints, metrics, plot, HF export.
Resuming restores the engine and the data position; everything that was derived from the initial
critic is kept in run_dir/prepared_rollouts.pt, so a resumed run ends bit-identical to an
uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from common import checkpoints
from common.config import TrainConfig, to_yaml
from common.data import Rollouts, gae_returns, load_rollouts, make_default_records, to_rollouts, validate_records
from common.distributed import DistContext, all_gather_object, barrier
from common.engine import RolloutBatch, build_engine, shift_to_tokens
from common.loss import explained_variance
from common.metrics import MetricsLogger, plot_metrics

PREPARED = "prepared_rollouts.pt"


def resolve_model_path(path: str, run_dir: str, dist: DistContext) -> str:
    """`embedded:<family>` -> a tiny random model written once into run_dir (by rank 0)."""
    if not path.startswith("embedded:"):
        return path
    from common.atomic_dir import atomic_directory
    from common.testdata import save_tiny_causal_lm

    family = path.removeprefix("embedded:")
    target = os.path.join(run_dir, f"embedded-{family}")
    if dist.is_main and not os.path.isfile(os.path.join(target, "config.json")):
        with atomic_directory(target, overwrite=True) as staging:
            save_tiny_causal_lm(family, staging)
    barrier()
    return target


def _vocab_size(model_path: str, trust_remote_code: bool) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config().vocab_size


def read_rollouts(config: TrainConfig, vocab_size: int) -> tuple[Rollouts, Rollouts]:
    """(train, eval) rollouts, validated; eval is data.eval_path or a held-out share of train."""
    data = config.data
    if data.train_path == "embedded:default":
        records = make_default_records(data.num_rollouts, seed=config.engine.seed)
        validate_records(records, vocab_size, "embedded:default")
        rollouts = to_rollouts(records)
    else:
        rollouts = load_rollouts(data.train_path, vocab_size)
    if data.eval_path is not None:
        return rollouts, load_rollouts(data.eval_path, vocab_size)
    order = torch.randperm(len(rollouts), generator=torch.Generator().manual_seed(config.engine.seed))
    held_out = int(round(len(rollouts) * data.eval_fraction))
    if data.eval_fraction > 0 and held_out == 0:
        held_out = 1
    return rollouts.select(order[held_out:]), rollouts.select(order[:held_out])


def _distributed_values(engine, rollouts: Rollouts, dist: DistContext) -> torch.Tensor:
    """Critic values [N, T] for all rollouts on every rank: each data-parallel rank computes a strided
    share (its model-parallel peers compute the same share with it), then the DP group gathers."""
    mine = torch.arange(engine.dp_rank, len(rollouts), engine.dp_size)
    values = engine.compute_values(rollouts.input_ids[mine], rollouts.attention_mask[mine])
    out = torch.zeros(rollouts.input_ids.shape, dtype=torch.float32)
    for index, share in all_gather_object((mine, values), group=engine.dp_group):
        out[index] = share
    return out


def prepare_targets(engine, rollouts: Rollouts, config: TrainConfig, dist: DistContext) -> Rollouts:
    """Fill in old values (the initial critic's predictions) and returns (GAE when given rewards)."""
    if rollouts.old_values is None or rollouts.returns is None:
        predictions = shift_to_tokens(_distributed_values(engine, rollouts, dist))
        if rollouts.old_values is None:
            rollouts.old_values = predictions * rollouts.response_mask
        if rollouts.returns is None:
            rollouts.returns = gae_returns(rollouts.rewards, rollouts.old_values, rollouts.response_mask,
                                           config.data.gamma, config.data.lam)
    return rollouts


def evaluate(engine, rollouts: Rollouts, config: TrainConfig, dist: DistContext) -> dict[str, float]:
    """Held-out value loss (unclipped, token-mean) and explained variance of the current critic."""
    predictions = shift_to_tokens(_distributed_values(engine, rollouts, dist))
    mask = rollouts.response_mask.bool()
    error = (predictions - rollouts.returns)[mask]
    return {
        "value_loss": float(0.5 * (error ** 2).mean()) if error.numel() else float("nan"),
        "explained_variance": explained_variance(predictions, rollouts.returns, rollouts.response_mask),
    }


def _batch(rollouts: Rollouts, index: torch.Tensor) -> RolloutBatch:
    part = rollouts.select(index)
    return RolloutBatch(part.input_ids, part.attention_mask, part.response_mask, part.old_values, part.returns)


def run_training(config: TrainConfig, dist: DistContext, *, say=None) -> dict[str, float]:
    trainer = config.trainer
    run_dir = os.path.abspath(trainer.run_dir)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    main = dist.is_main
    if say is None:
        from tqdm import tqdm

        say = tqdm.write  # prints above the progress bar instead of through it
    say = say if main else (lambda *a, **k: None)

    latest = checkpoints.find_latest(ckpt_root)
    if trainer.resume and latest is None:
        raise ValueError(f"--resume: no complete checkpoint in {ckpt_root}; run without --resume to start fresh")
    if not trainer.resume and latest is not None:
        raise ValueError(f"{run_dir} already holds checkpoints ({os.path.basename(latest)}); pass --resume to "
                         f"continue that run, or choose another trainer.run_dir")
    if main:
        os.makedirs(ckpt_root, exist_ok=True)
        checkpoints.prune(ckpt_root, keep_last=trainer.keep_last)  # staging left by an interrupted save
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(config))

    model_path = resolve_model_path(config.engine.model.path, run_dir, dist)
    prepared_file = os.path.join(run_dir, PREPARED)
    resuming = trainer.resume
    if resuming and not os.path.isfile(prepared_file):
        raise ValueError(f"--resume: {prepared_file} is missing, so the run's old values and returns cannot be "
                         f"restored; resume in the run_dir the checkpoint came from")
    if resuming:
        prepared = torch.load(prepared_file, weights_only=True)
        train, held_out = Rollouts(**prepared["train"]), Rollouts(**prepared["eval"])
    else:
        train, held_out = read_rollouts(config, _vocab_size(model_path, config.engine.model.trust_remote_code))
    mini = config.data.mini_batch_size
    steps_per_epoch = math.ceil(len(train) / mini)
    total_steps = steps_per_epoch * trainer.epochs
    optim = dataclasses.replace(config.engine.optim, total_steps=config.engine.optim.total_steps or total_steps)
    model_cfg = dataclasses.replace(config.engine.model, path=model_path)
    engine_cfg = dataclasses.replace(config.engine, optim=optim, model=model_cfg)

    engine = build_engine(config.backend, engine_cfg, dist)
    try:
        return _train(engine, config, dist, train, held_out, latest, resuming, say, steps_per_epoch)
    finally:
        engine.close()


def _train(engine, config: TrainConfig, dist: DistContext, train: Rollouts, held_out: Rollouts,
           latest: str | None, resuming: bool, say, steps_per_epoch: int) -> dict[str, float]:
    trainer = config.trainer
    main = dist.is_main
    run_dir = os.path.abspath(trainer.run_dir)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    prepared_file = os.path.join(run_dir, PREPARED)
    mini = config.data.mini_batch_size
    total_steps = steps_per_epoch * trainer.epochs
    say(str(engine.load_report))
    say(f"rollouts: {len(train)} train, {len(held_out)} held out; {steps_per_epoch} steps/epoch x "
        f"{trainer.epochs} epochs, mini-batch {mini} sequences over {engine.dp_size} data-parallel rank(s)")

    position = {"epoch": 0, "step_in_epoch": 0, "global_step": 0}
    if resuming:
        position = engine.load_checkpoint(latest)
        say(f"resumed from {latest} at epoch {position['epoch']}, step {position['global_step']}")
    else:
        train = prepare_targets(engine, train, config, dist)
        held_out = prepare_targets(engine, held_out, config, dist)
        if main:
            tmp = prepared_file + ".tmp"
            torch.save({"train": _as_dict(train), "eval": _as_dict(held_out)}, tmp)
            os.replace(tmp, prepared_file)
        barrier()

    metrics_log = MetricsLogger(run_dir, enabled=main, tensorboard=trainer.tensorboard)
    if not resuming:
        metrics_log.log(0, evaluate(engine, held_out, config, dist), prefix="eval")
    progress = _progress(total_steps, position["global_step"], enabled=main and trainer.progress)
    step = position["global_step"]
    for epoch in range(position["epoch"], trainer.epochs):
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(config.engine.seed * 1000 + epoch))
        first = position["step_in_epoch"] if epoch == position["epoch"] else 0
        for step_in_epoch in range(first, steps_per_epoch):
            rows = order[step_in_epoch * mini:(step_in_epoch + 1) * mini]
            metrics = engine.update(_batch(train, rows[engine.dp_rank::engine.dp_size]))  # a DP rank's share
            step += 1
            metrics_log.log(step, metrics)
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['value_loss']:.4f}", ev=f"{metrics['explained_variance']:.3f}",
                                 refresh=False)
            next_position = {"epoch": epoch, "step_in_epoch": step_in_epoch + 1, "global_step": step}
            if step_in_epoch + 1 == steps_per_epoch:
                next_position = {"epoch": epoch + 1, "step_in_epoch": 0, "global_step": step}
            if trainer.save_every_steps and step % trainer.save_every_steps == 0 and step != total_steps:
                _save(engine, ckpt_root, step, next_position, trainer.keep_last, main, say)
        held = evaluate(engine, held_out, config, dist)
        metrics_log.log(step, held, prefix="eval")
        say(f"epoch {epoch + 1}/{trainer.epochs}: train loss {metrics['value_loss']:.4f}, held-out loss "
            f"{held['value_loss']:.4f}, held-out explained_variance {held['explained_variance']:.3f}")
    progress.close()

    _save(engine, ckpt_root, step, {"epoch": trainer.epochs, "step_in_epoch": 0, "global_step": step},
          trainer.keep_last, main, say)
    if trainer.export_hf:
        export_dir = os.path.join(run_dir, "hf_export")
        engine.export_hf(export_dir)
        say(f"exported {export_dir} (load it with transformers.AutoModelForTokenClassification)")
    metrics_log.close()
    if main and trainer.plot:
        say(f"plot: {plot_metrics(metrics_log.path, os.path.join(run_dir, 'training.png'))}")
    final = evaluate(engine, held_out, config, dist)
    say(_sample_line(engine, held_out, dist))
    say(f"final explained_variance={final['explained_variance']:.4f}")
    return final


def _sample_line(engine, rollouts: Rollouts, dist: DistContext) -> str:
    """The trained critic's values next to the returns for the first response tokens of held-out rollout 0."""
    first = rollouts.select(torch.tensor([0]))
    predictions = shift_to_tokens(_distributed_values(engine, first, dist))[0]
    tokens = first.response_mask[0].bool().nonzero().flatten()[:8]
    values = [round(v, 3) for v in predictions[tokens].tolist()]
    returns = [round(r, 3) for r in first.returns[0, tokens].tolist()]
    return f"held-out rollout 0, first response tokens: values {values} vs returns {returns}"


def _save(engine, root: str, step: int, position: dict, keep_last: int, main: bool, say) -> None:
    directory = checkpoints.step_dir(root, step)
    engine.save_checkpoint(directory, position)
    if main:
        checkpoints.mark_latest(root, directory)
        checkpoints.prune(root, keep_last=keep_last)
    barrier()
    say(f"checkpoint saved: {os.path.basename(directory)}")


def _as_dict(rollouts: Rollouts) -> dict:
    return {f.name: getattr(rollouts, f.name) for f in dataclasses.fields(rollouts)}


def _progress(total: int, done: int, *, enabled: bool):
    from tqdm import tqdm

    # disable=None: tqdm draws only on a terminal (logs get the per-epoch lines instead).
    return tqdm(total=total, initial=done, disable=True if not enabled else None, desc="critic", unit="step",
                mininterval=1.0, dynamic_ncols=True)


def dry_run(config: TrainConfig, dist: DistContext, *, say=print) -> None:
    """Check config, model checkpoint and rollouts without building the engine or training."""
    from common.valuehead.cli import inspect_checkpoint

    say = say if dist.is_main else (lambda *a, **k: None)
    model_path = resolve_model_path(config.engine.model.path, os.path.abspath(config.trainer.run_dir), dist)
    info = inspect_checkpoint(model_path, head_prefix=config.engine.model.head_prefix,
                              trust_remote_code=config.engine.model.trust_remote_code)
    say(f"model: {model_path}: {info['format']}, {info['family']} -> {info['critic_class']}, "
        f"initialise {info['would_initialise'] or 'nothing'}")
    train, held_out = read_rollouts(config, _vocab_size(model_path, config.engine.model.trust_remote_code))
    tokens = int(train.attention_mask.sum())
    say(f"rollouts: {len(train)} train ({tokens} tokens), {len(held_out)} held out; config OK")
