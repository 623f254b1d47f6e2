"""Torchrun worker of the conformance suite: one backend's engine through the whole contract on 2
ranks, each rank writing what it saw to WORKDIR/rank<r>.json (test_conformance.py checks it).

  python -m critic_adapters.tests.conformance.worker BACKEND MODEL_DIR WORKDIR [--spec JSON] [--moe MOE_DIR]

In order: a warm-up engine (lazy imports may install their own warning filters or attention
names once), then a snapshot of the process's state; an engine's coordinates; a save that fails on
rank 0 only; an update with a value mask; NaN returns on rank 1 only; an update, a save, an HF export, an offload cycle and the next update, a second engine loading
that checkpoint and taking the same update; then, from that export, one engine at each model-parallel layout of two ranks the
backend's spec offers (tensor, pipeline, context, ulysses at degree 2; `layouts`) calling every
method of the contract; close, then every patched function, environment variable, RNG and warning
filter compared with the snapshot; then shutdown and the gloo worker threads still alive.

With --moe MOE_DIR, the same layout pass then runs on that mixture-of-experts critic at data
parallel 2, and at expert parallel 2 where the spec offers it.

A backend that is not built in (a host's, registered in the test process) reaches the worker as
its spec (--spec JSON: a "module:callable" factory, its dimensions and knobs), registered here
under the same name.
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
import time
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.engine.config import (
    BatchingConfig,
    EngineConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
)
from critic_adapters.common.parallel.distributed import all_gather_object, barrier, gloo_worker_threads, init_distributed, shutdown
from critic_adapters.common.engine import RolloutBatch, contract_members
from critic_adapters.common.parallel.batching import data_parallel_shares
from critic_adapters.common.tests.helpers import FIELDS
from critic_adapters.common.engine.registry import BACKENDS, BackendSpec, backend_spec, build_engine, register_backend
from critic_adapters.common.valuehead import compute_values, load_critic

# Process-wide things an engine might patch: (module name, attribute). Compared by identity.
WATCHED = [("torch.cuda", name) for name in ("current_device", "synchronize", "empty_cache", "is_available")] + [
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb"),
    ("megatron.core.utils", "GlobalMemoryBuffer.get_tensor"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER"),
    ("transformers.loss.loss_utils", "LOSS_MAPPING"),
]
NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _lookup(module_name: str, dotted: str):
    obj = sys.modules.get(module_name)
    if obj is None:
        return "<not imported>"
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def snapshot() -> dict:
    from transformers import AttentionInterface

    return {
        "watched": {f"{m}:{a}": id(_lookup(m, a)) for m, a in WATCHED},
        "environ": dict(os.environ),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "warning_filters": list(warnings.filters),
        "attention": {k: id(v) for k, v in AttentionInterface._global_mapping.items()},
    }


def changes(before: dict, after: dict) -> list[str]:
    out = [f"{key} was replaced" for key, ident in before["watched"].items()
           if ident != after["watched"][key] and "<not imported>" not in key]
    env_keys = set(before["environ"]) | set(after["environ"])
    out += [f"os.environ[{k}]: {before['environ'].get(k)!r} -> {after['environ'].get(k)!r}"
            for k in sorted(env_keys) if before["environ"].get(k) != after["environ"].get(k)]
    if not torch.equal(before["torch_rng"], after["torch_rng"]):
        out.append("torch's global RNG moved")
    if before["python_rng"] != after["python_rng"]:
        out.append("python's random moved")
    if before["warning_filters"] != after["warning_filters"]:
        out.append("warnings.filters changed")
    out += [f"attention {name!r} was overridden" for name, ident in before["attention"].items()
            if after["attention"].get(name) != ident]
    return out


TIMEOUT_S = 60.0  # engine.collective_timeout_s: a rank left waiting raises within it


def engine_config(model_dir: str, parallel: ParallelConfig | None = None) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3),
                        loss=LossConfig(clip_range=0.2), batching=BatchingConfig(micro_batch_tokens=64),
                        parallel=parallel or ParallelConfig(), collective_timeout_s=TIMEOUT_S)


# The model-parallel layouts of two ranks, by the spec dimension that offers each (data parallel 2
# is the main pass). Megatron's sequence_parallel is a switch of the tensor layout, tested with it
# elsewhere (backends/megatron/tests).
LAYOUTS = {"tensor": {"tensor": 2}, "pipeline": {"pipeline": 2}, "context": {"context": 2}, "ulysses": {"ulysses": 2}}


def layouts(spec: BackendSpec) -> list[str]:
    """The names (LAYOUTS keys) of every two-rank model-parallel layout `spec` offers."""
    return [name for name in LAYOUTS if name in spec.parallel_dims]


def spec_json(spec: BackendSpec) -> str:
    """A spec with a "module:callable" factory as the worker's --spec argument."""
    if not isinstance(spec.factory, str):
        raise ValueError("the conformance worker runs in its own process: register the backend with a "
                         "\"module:callable\" factory string, not the callable itself")
    return json.dumps({"factory": spec.factory, "parallel_dims": sorted(spec.parallel_dims),
                       "knobs": sorted(spec.knobs)})


def register_from_json(name: str, text: str) -> None:
    """Register the test process's spec of `name` here, unless this process has it already (a built-in
    backend keeps its whole spec: launcher, check_layout, ...)."""
    fields = json.loads(text)
    spec = BackendSpec(factory=fields["factory"], parallel_dims=frozenset(fields["parallel_dims"]),
                       knobs=frozenset(fields["knobs"]))
    known = BACKENDS.get(name)
    if known is None or (known.factory, known.parallel_dims, known.knobs) != (spec.factory, spec.parallel_dims,
                                                                               spec.knobs):
        register_backend(name, spec, replace=True)


def rollout(rank: int, nan: bool = False) -> RolloutBatch:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 990, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    response = torch.zeros_like(ids)
    response[:, 4:] = 1
    response *= mask
    returns = torch.randn(3, 12, generator=g) * response
    if nan:
        returns[0, 5] = float("nan")
    return RolloutBatch(ids * mask, mask, response, torch.zeros(3, 12), returns)


def skewed_rollout() -> RolloutBatch:
    """Eight rows, two of them 8x the others' length (every rank holds all of them)."""
    g = torch.Generator().manual_seed(7)
    lengths = [48, 6, 6, 6, 48, 6, 6, 6]
    ids = torch.randint(3, 990, (8, 48), generator=g)
    mask = (torch.arange(48)[None] < torch.tensor(lengths)[:, None]).long()
    response = mask.clone()
    response[:, :2] = 0
    returns = torch.randn(8, 48, generator=g) * response
    return RolloutBatch(ids * mask, mask, response, torch.zeros(8, 48), returns)


def shares_change_where_not_what(engine, checkpoint: str) -> dict:
    """One update of the skewed mini-batch from the same checkpoint, its rows shared rows r::n and
    then balanced by tokens (the trainer's data_parallel_shares): the step must not change, only
    how many tokens the busiest rank holds. Leaves the engine at the checkpoint."""
    batch = skewed_rollout()
    n, rank = engine.dp_size, engine.dp_rank
    ways = {"strided": [torch.arange(r, 8, n) for r in range(n)],
            "balanced": data_parallel_shares(batch.attention_mask, n)}
    out = {}
    for name, shares in ways.items():
        engine.load_checkpoint(checkpoint)
        mine = shares[rank]
        metrics = engine.update(RolloutBatch(*(getattr(batch, f)[mine] for f in FIELDS)))
        out[name] = {"metrics": {k: metrics[k] for k in ("value_loss", "grad_norm", "explained_variance")},
                     "values": engine.compute_values(batch.input_ids, batch.attention_mask),
                     "largest_share_tokens": max(int(batch.attention_mask[s].sum()) for s in shares)}
    engine.load_checkpoint(checkpoint)
    out["values_diff"] = float((out["strided"].pop("values") - out["balanced"].pop("values")).abs().max())
    return out


def value_mask_step(engine, checkpoint: str) -> dict:
    """One update with a value mask from the checkpoint (the skewed mini-batch, balanced shares: several
    micro-batches on a rank; every other response token, and a whole row less on rank 1, so the ranks
    count different numbers of tokens), beside the same update with response_mask = that mask and the
    plain one; the loss the step reports against the clipped loss computed here from the values before
    it over the value-mask tokens of every rank. Leaves the engine at the checkpoint."""
    import dataclasses

    from critic_adapters.common.engine import shift_to_tokens
    from critic_adapters.common.learning.loss import value_loss

    whole = skewed_rollout()
    mine = data_parallel_shares(whole.attention_mask, engine.dp_size)[engine.dp_rank]
    batch = whole.map(lambda tensor: tensor[mine])
    value_mask = batch.response_mask.clone()
    value_mask[:, ::2] = 0
    if engine.dp_rank == 1:
        value_mask[0] = 0
    steps = {"masked": dataclasses.replace(batch, value_mask=value_mask),
             "as_response": dataclasses.replace(batch, response_mask=value_mask),
             "plain": batch}
    out, after = {}, {}
    for name, step in steps.items():
        engine.load_checkpoint(checkpoint)
        before = shift_to_tokens(engine.compute_values(whole.input_ids, whole.attention_mask))
        metrics = engine.update(step)
        out[name] = {k: metrics[k] for k in ("value_loss", "grad_norm", "valid_tokens", "explained_variance")}
        after[name] = engine.compute_values(whole.input_ids, whole.attention_mask)
    engine.load_checkpoint(checkpoint)
    # Every rank's share of the mini-batch, gathered: the reference loss over the value-mask tokens.
    shares = all_gather_object((mine, value_mask), group=engine.dp_group)
    full_mask = torch.zeros_like(whole.response_mask)
    for rows, mask in shares:
        full_mask[rows] = mask
    reference, stats = value_loss(before, whole.old_values, whole.returns, full_mask, clip_range=0.2)
    out["reference"] = {"value_loss": float(reference), "valid_tokens": stats["valid_tokens"]}
    out["after_diff"] = {name: float((after[name] - after["masked"]).abs().max()) for name in ("as_response", "plain")}
    return out


def _outcome(call) -> dict:
    start = time.monotonic()
    try:
        call()
        raised = None
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        kind = next((base.__name__ for base in (ValueError, OSError) if isinstance(err, base)), type(err).__name__)
        raised = {"type": type(err).__name__, "kind": kind, "message": str(err)}
    return {"raised": raised, "seconds": time.monotonic() - start}


def _with_trainer_state_failing(engine, name: str, on_rank: int, error: OSError, call) -> dict:
    """call() on every rank while torch.<name> (save or load) raises `error` on rank `on_rank` for
    the checkpoint's trainer_state.pt."""
    real = getattr(torch, name)

    def failing(*args, **kwargs):
        if str(args[1] if name == "save" else args[0]).endswith("trainer_state.pt"):
            raise error
        return real(*args, **kwargs)

    if engine.dist.rank == on_rank:
        setattr(torch, name, failing)
    try:
        return _outcome(call)
    finally:
        setattr(torch, name, real)


def failing_save(engine, directory: str) -> dict:
    """Rank 0's trainer-state write fails (disk full) after the shards are written."""
    return _with_trainer_state_failing(engine, "save", 0, OSError(errno.ENOSPC, "No space left on device"),
                                       lambda: engine.save_checkpoint(directory))


def failing_load(engine, directory: str) -> dict:
    """Rank 1 cannot read the checkpoint's trainer state (after the collective load of the shards)."""
    return _with_trainer_state_failing(engine, "load", 1, OSError(errno.EIO, "Input/output error"),
                                       lambda: engine.load_checkpoint(directory))


def failing_export(engine, workdir: str) -> dict:
    """Rank 0, the one that writes the export, finds a file where the export's parent should be."""
    blocker = os.path.join(workdir, "not_a_directory")
    if engine.dist.is_main:
        open(blocker, "w").close()
    barrier(engine.parallel.world_group)
    return _outcome(lambda: engine.export_hf(os.path.join(blocker, "hf_export")))


def planned(backend: str, config: EngineConfig, dist) -> list[int] | None:
    """This rank's (parameters, gradients, optimizer) bytes by the job plan's count, from the config alone."""
    from critic_adapters.common.engine.memory import state_memory
    from critic_adapters.common.engine.registry import check_layout

    if backend not in BACKENDS or not isinstance(BACKENDS[backend].factory, str) or \
            not BACKENDS[backend].factory.startswith(".backends."):
        return None  # a host's backend: the plan knows only the built-in ones
    critic_config = check_layout(backend, config, dist.world_size).critic_config
    state = state_memory(backend, config, critic_config, dist.world_size, dist.rank)
    return None if state is None else list(state)


def step_in_pieces(engine, batch: RolloutBatch, workdir: str, planned=None) -> dict:
    """The contract's other methods: forward_backward (values equal compute_values; with a loss, a
    step_optimizer after zero_grad and a second call moves the critic), parameter counts, the
    adapter export a critic without LoRA refuses. With the plan's (parameters, gradients, optimizer)
    bytes (common.engine.memory.state_memory), what resident_bytes() said: the gradients after the
    backward, the parameters and the optimizer state after the step."""
    before = engine.compute_values(batch.input_ids, batch.attention_mask)
    values, loss = engine.forward_backward(batch.input_ids, batch.attention_mask)
    mask = batch.attention_mask.bool()
    out = {"values_diff": float((values.cpu() - before)[mask].abs().max()), "loss_without_fn": loss}

    def loss_fn(v):
        return (v.float() ** 2).sum() / mask.sum()

    engine.forward_backward(batch.input_ids, batch.attention_mask, loss_fn)
    engine.zero_grad()
    trained, loss = engine.forward_backward(batch.input_ids, batch.attention_mask, loss_fn)
    held_grads = engine.resident_bytes()["grads"]
    # The contract's form (issue 49: fsdp and VeOmni returned them on the device, megatron on the CPU).
    out["returned"] = [str(t.device.type) + " " + str(t.dtype) + (" grad" if t.requires_grad else "")
                       for t in (values, trained, loss)]
    out["loss"] = float(loss)
    out["grad_norm"] = engine.step_optimizer()
    after_step = engine.resident_bytes()
    out["memory"] = {"planned": planned, "resident": [after_step["model"], held_grads, after_step["optimizer"]]}
    engine.scheduler.step()
    out["moved"] = float((engine.compute_values(batch.input_ids, batch.attention_mask) - before)[mask].abs().max())
    out["counts"] = list(engine.parameter_counts())
    out["data_parallel_ranks"] = engine.data_parallel_ranks
    try:
        engine.export_adapter(os.path.join(workdir, f"adapter{torch_dist.get_rank()}"))
        out["adapter"] = None
    except ValueError as err:
        out["adapter"] = str(err)
    return out


def offload_phases(engine, batch: RolloutBatch) -> dict:
    """offload / onload as a host's phases drive them: the optimizer and gradients off for a
    rollout (values still computed, an update refused), then the model too (values refused), each
    twice (the second a no-op), then everything back, bit for bit."""
    ids, mask = batch.input_ids, batch.attention_mask
    before = engine.compute_values(ids, mask)
    resident = engine.resident_bytes()
    engine.offload(model=False)
    out = {"rollout_phase": sorted(engine.offloaded), "rollout_bytes": engine.resident_bytes(),
           "rollout_values_equal": torch.equal(engine.compute_values(ids, mask), before),
           "update_refused": _outcome(lambda: engine.update(batch))["raised"]}
    engine.offload()
    engine.offload()
    out["offloaded"] = sorted(engine.offloaded)
    out["offloaded_bytes"] = engine.resident_bytes()
    out["values_refused"] = _outcome(lambda: engine.compute_values(ids, mask))["raised"]
    engine.onload(optimizer=False, grads=False)  # verl's next rollout: the model back, the optimizer stays off
    out["model_back"] = {"offloaded": sorted(engine.offloaded),
                         "values_equal": torch.equal(engine.compute_values(ids, mask), before)}
    engine.onload()
    engine.onload()
    out["after_onload"] = sorted(engine.offloaded)
    out["resident"] = [resident, engine.resident_bytes()]
    out["values_equal_after"] = torch.equal(engine.compute_values(ids, mask), before)
    return out


def _update_and_values(engine, rank: int) -> dict:
    """The next update's loss and grad norm, and this rank's values after it."""
    metrics = engine.update(rollout(rank + 2))
    batch = rollout(rank)
    return {"value_loss": metrics["value_loss"], "grad_norm": metrics["grad_norm"],
            "values_after": engine.compute_values(batch.input_ids, batch.attention_mask).tolist()}


def _masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.cpu() - b.cpu()).abs()[mask.bool()].max())


# Issue 44: the optimizer options, each with the spec's knob that offers it.
OPTIMIZER_OPTIONS = {"muon": ("optim.name", {"name": "muon"}),
                     "bf16_state": ("optim.state_dtype", {"state_dtype": "bfloat16"}),
                     "muon_bf16_state": ("optim.name", {"name": "muon", "state_dtype": "bfloat16"}),
                     "offload_state": ("optim.offload_state", {"offload_state": True})}


def optimizer_pass(backend: str, dist, export_dir: str, workdir: str) -> dict:
    """Each optimizer option from `export_dir` (the main pass's export): the first update's metrics and
    the values after it (rank 0's rows), for the test's torch reference; offload_state also beside
    the plain AdamW update, its optimizer bytes between steps, and across a save and a load. An option
    the spec does not offer: the refusal it raises."""
    import dataclasses

    spec = backend_spec(backend)
    out = {}
    for name, (knob, settings) in OPTIMIZER_OPTIONS.items():
        base = engine_config(export_dir)
        config = dataclasses.replace(base, optim=dataclasses.replace(base.optim, **settings))
        if knob not in spec.knobs:
            try:
                build_engine(backend, config, dist).close()
                out[name] = {"refused": None}
            except ValueError as err:
                out[name] = {"refused": str(err)}
            continue
        engine = build_engine(backend, config, dist)
        batch = rollout(0)
        metrics = engine.update(rollout(dist.rank + 2))
        result = {"metrics": {k: metrics[k] for k in ("value_loss", "grad_norm")},
                  "values_after_first": engine.compute_values(batch.input_ids, batch.attention_mask).tolist(),
                  "optimizer_bytes_after_step": engine.resident_bytes()["optimizer"],
                  "planned": planned(backend, config, dist),
                  "offloaded_after_step": sorted(engine.offloaded)}
        saved = os.path.join(workdir, f"ckpt-optim-{name}")
        engine.save_checkpoint(saved)
        engine.load_checkpoint(saved)
        result["optimizer_bytes_after_load"] = engine.resident_bytes()["optimizer"]
        result["next"] = engine.update(rollout(dist.rank + 4))["value_loss"]
        result["values_after"] = engine.compute_values(batch.input_ids, batch.attention_mask).tolist()
        if name == "muon":  # AdamW's state (the main pass's checkpoint) does not load into Muon
            result["adamw_checkpoint"] = _outcome(lambda: engine.load_checkpoint(os.path.join(workdir, "ckpt")))
        engine.close()
        out[name] = result
    return out


def moe_layouts(spec: BackendSpec) -> dict[str, dict]:
    """The mixture-of-experts passes: data parallel 2, and expert parallel 2 where the spec offers it."""
    return {"moe": {}, **({"moe-expert": {"expert": 2}} if "expert" in spec.parallel_dims else {})}


def layout_pass(backend: str, layout: str, dist, export_dir: str, reference: torch.Tensor, workdir: str,
                parallel: dict | None = None) -> dict:
    """One engine at `layout` (engine.parallel `parallel`, else LAYOUTS[layout]), built from
    `export_dir` (the main pass's export), through every method: its coordinates, the export's
    values, the step in pieces, an update, a save, the next update, a load of that save, an offload /
    onload cycle and the same update again (bit for bit), an export written while offloaded. Every
    rank passes the same rows (rollout(0))."""
    parallel = LAYOUTS[layout] if parallel is None else parallel
    engine = build_engine(backend, engine_config(export_dir, ParallelConfig(**parallel)), dist)
    batch = rollout(0)
    ids, mask = batch.input_ids, batch.attention_mask
    out = {"degrees": engine.parallel.degrees(), "dp": [engine.dp_rank, engine.dp_size],
           "dp_group_size": torch_dist.get_world_size(engine.dp_group),
           "reports_outputs": engine.parallel.reports_outputs,
           "missing_members": [name for name in contract_members() if not hasattr(engine, name)]}
    out["values_diff"] = _masked_diff(engine.compute_values(ids, mask), reference, mask)
    out["pieces"] = step_in_pieces(engine, batch, workdir, planned(backend, engine_config(export_dir,
                                                                                   ParallelConfig(**parallel)), dist))
    out["first_update"] = engine.update(rollout(2))
    saved = os.path.join(workdir, f"ckpt-{layout}")
    engine.save_checkpoint(saved)
    at_save = engine.compute_values(ids, mask)
    next_update = engine.update(rollout(4))
    engine.load_checkpoint(saved)
    out["reload_values_diff"] = _masked_diff(engine.compute_values(ids, mask), at_save, mask)
    engine.offload()
    engine.onload()
    again = engine.update(rollout(4))
    out["next_update"] = [next_update["value_loss"], next_update["grad_norm"]]
    out["reloaded_update"] = [again["value_loss"], again["grad_norm"]]
    engine.offload()
    engine.export_hf(os.path.join(workdir, f"hf_export-{layout}"))
    out["offloaded_after_export"] = sorted(engine.offloaded)
    engine.onload()
    at_export = engine.compute_values(ids, mask)
    if dist.is_main:
        torch.save(at_export, os.path.join(workdir, f"values-{layout}.pt"))
    engine.close()
    return out


def main() -> None:
    backend, model_dir, workdir = sys.argv[1:4]
    if "--spec" in sys.argv:  # the backend as the test process has it registered
        register_from_json(backend, sys.argv[sys.argv.index("--spec") + 1])
    assert backend in BACKENDS, f"backend {backend!r} is not registered in the worker"
    dist = init_distributed()
    config = engine_config(model_dir)
    out: dict = {}

    build_engine(backend, config, dist).close()  # warm-up: first imports
    before = snapshot()

    engine = build_engine(backend, config, dist)
    out["coords"] = {"dp_rank": engine.dp_rank, "dp_size": engine.dp_size,
                     "parallel_dp_rank": engine.parallel.dp_rank, "parallel_dp_size": engine.parallel.dp_size,
                     "dp_group_size": torch_dist.get_world_size(engine.dp_group)}
    out["all_dp_ranks"] = sorted(all_gather_object(engine.dp_rank, group=engine.parallel.world_group))
    out["missing_members"] = [name for name in contract_members() if not hasattr(engine, name)]
    out["pieces"] = step_in_pieces(engine, rollout(dist.rank), workdir, planned(backend, config, dist))
    out["offload"] = offload_phases(engine, rollout(dist.rank))

    good = os.path.join(workdir, "ckpt")
    engine.update(rollout(dist.rank + 4))  # megatron's optimizer has no state to load before its first step
    engine.save_checkpoint(good)
    values_at_save = engine.compute_values(rollout(dist.rank).input_ids, rollout(dist.rank).attention_mask)
    out["failing_save"] = failing_save(engine, good)
    barrier(engine.parallel.world_group)  # rank 0 removes the staging directory after the others have raised
    out["staging_left"] = sorted(n for n in os.listdir(workdir) if n.startswith("."))
    out["failing_load"] = failing_load(engine, good)
    out["failing_export"] = failing_export(engine, workdir)
    engine.load_checkpoint(good)  # the old checkpoint still loads
    out["old_checkpoint_values_diff"] = float(
        (engine.compute_values(rollout(dist.rank).input_ids, rollout(dist.rank).attention_mask) - values_at_save)
        .abs().max())
    out["shares"] = shares_change_where_not_what(engine, good)
    out["value_mask"] = value_mask_step(engine, good)

    values_before_nan = engine.compute_values(rollout(dist.rank).input_ids, rollout(dist.rank).attention_mask)
    try:
        engine.update(rollout(dist.rank, nan=dist.rank == 1))
        out["nan"] = {"raised": None}
    except ValueError as err:
        out["nan"] = {"raised": str(err)}
    out["nan"]["values_diff"] = float(  # the refused step changed no weight, on any rank
        (engine.compute_values(rollout(dist.rank).input_ids, rollout(dist.rank).attention_mask) - values_before_nan)
        .abs().max())

    version_before = engine.version
    metrics = engine.update(rollout(dist.rank))  # and the group takes the next step
    out["after_nan_loss"] = metrics["value_loss"]
    out["metrics_keys"] = sorted(metrics)
    resumed_dir = os.path.join(workdir, "after_update")
    # A host's replay buffer saved with the checkpoint: each rank passes its own shard ("replay",
    # "ages") and a tensor every rank has alike ("step"); each rank gets its own back (issue 49).
    buffer = {"replay": torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * dist.rank,
              "ages": torch.tensor([3, 1], dtype=torch.int64) + dist.rank, "step": torch.tensor(5)}
    engine.save_checkpoint(resumed_dir, {"position": 7}, extra_tensors=buffer)
    values, values_version = engine.compute_values(rollout(dist.rank).input_ids, rollout(dist.rank).attention_mask,
                                                   return_version=True)
    out["version"] = {"before_update": version_before, "after_update": engine.version,
                      "values_version": values_version}
    export_dir = os.path.join(workdir, "hf_export")
    engine.export_hf(export_dir)
    # An export, then an offload cycle, then the next update: it must be the one an engine that did
    # neither takes (the second engine, resumed from the same checkpoint). An export once aliased
    # parameter storages into numpy, and the offload then re-pointed them, cutting megatron's
    # gradient hooks: the embedding, norms and head took no gradient.
    engine.offload()
    engine.onload()
    out["next_update"] = _update_and_values(engine, dist.rank)
    engine.close()

    second = build_engine(backend, config, dist)
    out["version"]["fresh_engine"] = second.version
    extra = second.load_checkpoint(resumed_dir)
    saved = extra.pop("extra_tensors", {})
    out["version"]["resumed"] = second.version
    out["extra"] = {"state": extra, "tensors_are_this_ranks": sorted(saved) == sorted(buffer) and all(
        torch.equal(saved[name], buffer[name]) for name in buffer), "tensors": {k: v.tolist() for k, v in saved.items()}}
    resumed = second.compute_values(rollout(dist.rank).input_ids, rollout(dist.rank).attention_mask)
    out["resume_values_diff"] = float((resumed - values).abs().max())
    out["resumed_next_update"] = _update_and_values(second, dist.rank)
    second.close()
    torch.save(values, os.path.join(workdir, f"values{dist.rank}.pt"))
    reference = all_gather_object(values, group=torch_dist.group.WORLD)[0]  # rank 0's rows: rollout(0)
    out["layouts"] = {layout: layout_pass(backend, layout, dist, export_dir, reference, workdir)
                      for layout in layouts(backend_spec(backend))}
    out["optimizers"] = optimizer_pass(backend, dist, export_dir, workdir)
    # The plain AdamW engine's same two updates: what offload_state must equal bit for bit.
    plain = build_engine(backend, engine_config(export_dir), dist)
    out["optimizers"]["adamw"] = {"metrics": {k: v for k, v in plain.update(rollout(dist.rank + 2)).items()
                                              if k in ("value_loss", "grad_norm")},
                                  "next": plain.update(rollout(dist.rank + 4))["value_loss"],
                                  "values_after": plain.compute_values(rollout(0).input_ids,
                                                                       rollout(0).attention_mask).tolist()}
    plain.close()
    if "--moe" in sys.argv:  # a mixture-of-experts critic written by transformers
        moe_dir = sys.argv[sys.argv.index("--moe") + 1]
        batch = rollout(0)
        moe_reference = compute_values(load_critic(moe_dir)[0], batch.input_ids, batch.attention_mask)
        out["moe"] = {name: layout_pass(backend, name, dist, moe_dir, moe_reference, workdir, parallel)
                      for name, parallel in moe_layouts(backend_spec(backend)).items()}

    out["side_effects"] = changes(before, snapshot())
    shutdown()
    out["gloo_threads_after_shutdown"] = len(gloo_worker_threads())
    with open(os.path.join(workdir, f"rank{dist.rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
