"""The engine layer: the contract every backend implements (this module), how an engine is chosen
and configured (registry: the backend specs and build_engine; config: EngineConfig and the job's
config; mesh: the ParallelMesh) and the pieces backends build engines from (pipeline and transforms:
load -> transforms -> parallelise, with LoRA in lora; schedule; update_step: one optimizer step over
micro-batches; fsdp2_core: the FSDP2 engine fsdp and veomni share). It may import common.parallel,
common.learning, common.storage, common.valuehead and common.testdata; never common.job or a
backend.

An engine owns a critic, its optimizer and schedule, and its parallelisation. The contract
(docs/ARCHITECTURE.md, "The engine contract", says the same in one place):

  parallel                       the engine's common.engine.mesh.ParallelMesh: degrees, coordinates and
                                 the process group of every parallel dimension.
  dp_rank, dp_size, dp_group     this rank's data-parallel coordinates (parallel's). The trainer
                                 gives each DP rank its share of every mini-batch, balanced by
                                 tokens (common.parallel.batching.data_parallel_shares); the
                                 tensor/pipeline/sequence-parallel peers of a DP rank receive the
                                 same rows.
  compute_values(input_ids, attention_mask, multi_modal_inputs=None) -> float32 [B, T] on CPU, values
                                 at every position (unshifted), for the rows this rank passed (a vision
                                 critic's images: one dict or None per row); every rank of the DP
                                 rank's model-parallel group returns them (with pipeline parallelism
                                 the last stage's values are sent to every stage). return_version=True:
                                 (values, the version that computed them)
  version                        optimizer steps taken (step_optimizer calls); saved in checkpoints
  update(batch) -> metrics       one optimizer step on this DP rank's share of a mini-batch; the loss
                                 is normalised over the whole mini-batch (all DP ranks, all
                                 micro-batches), gradients are those of that loss, and the metrics
                                 (common.engine.update_step.METRICS) are reduced over the DP group.
  save_checkpoint(dir, extra_state, extra_tensors=None) / load_checkpoint(dir) -> extra_state
                                 collective; atomic, fingerprinted (common/storage/checkpoints.py); loading
                                 restores the engine's own RNG (never the process's) and version; a
                                 host's extra tensors (a replay buffer) come back under "extra_tensors".
  checkpoint_bytes() -> int      the bytes a save writes (all ranks), for the free-space check
  export_hf(dir, max_shard_size=) a plain *ForTokenClassification, streamed tensor by tensor
                                 (common.valuehead.save.write_critic)
  load_report                    common.valuehead.LoadReport of the checkpoint the critic came from
  forward_backward / step_optimizer / zero_grad, scheduler
                                 the step in pieces, for a host's own loop and loss (verl's slot)
  export_adapter(dir)            a LoRA critic's peft adapter directory
  offload(model, optimizer, grads) / onload(model, optimizer, grads), offloaded, resident_bytes()
                                 the critic's state off the compute device between phases, storage
                                 by storage (common/engine/offload.py), for sharing GPUs with an actor
  data_parallel_ranks, parameter_counts()   what the console reports
  close()                        release it; before the process group is destroyed
The CriticEngine Protocol below holds the whole surface with its docstrings; the conformance suite
(tests/conformance) checks every registered backend against it.
Building an engine has no process-wide side effects: no global seeding, warning filters or
environment changes.

Importing this package imports no backend (common/engine/registry.py imports one only when it is built).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import torch

from ..parallel.distributed import all_reduce
from ..learning.loss import shift_to_tokens  # noqa: F401 - part of the engine API (the loss's alignment)
from ..valuehead.multimodal import as_rows, select


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutBatch:
    """One rank's share of a mini-batch; all tensors [B, T], right- or left-padded.

    Per-token fields are aligned with input_ids: response_mask[t] = 1 when token t is a response
    token; old_values[t] and returns[t] belong to that token. The critic's prediction for token t is
    its value at position t - 1 (the state before the token), as in verl, OpenRLHF and trl.
    value_mask (optional, a subset of response_mask; None: response_mask) marks the tokens whose
    values the critic regresses: the loss, its normalisation over the whole mini-batch, the clip
    fraction and the explained variance count those tokens only (an agent's action tokens may be
    more than the tokens worth a value target, e.g. VAGEN's turn anchors).
    multi_modal_inputs (optional, a vision-language critic's): one dict of the processor's tensors per
    row (pixel_values, image_grid_thw, video keys; common.valuehead.multimodal), or None / {} for a
    text row, with input_ids holding the expanded placeholders; kept as a tuple of dicts.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    value_mask: torch.Tensor | None = None
    multi_modal_inputs: tuple | None = None

    def __post_init__(self):
        shape = self.input_ids.shape
        object.__setattr__(self, "multi_modal_inputs", as_rows(self.multi_modal_inputs, shape[0]))
        for field in _TOKEN_FIELDS:
            tensor = getattr(self, field)
            if tensor is not None and tensor.shape != shape:
                raise ValueError(f"RolloutBatch.{field} has shape {tuple(tensor.shape)}, input_ids {tuple(shape)}")
        if bool((self.response_mask.bool() & ~self.attention_mask.bool()).any()):
            raise ValueError("RolloutBatch.response_mask marks padding positions as response tokens")
        if shape[-1] and bool(self.response_mask[:, 0].any()):
            raise ValueError("RolloutBatch.response_mask marks position 0: a response token needs a token before it")
        if self.value_mask is not None:
            outside = int((self.value_mask.bool() & ~self.response_mask.bool()).sum())
            if outside:
                raise ValueError(f"RolloutBatch.value_mask marks {outside} token(s) outside response_mask: the critic "
                                 f"regresses values of response tokens only (value_mask must be a subset of it)")

    @property
    def loss_mask(self) -> torch.Tensor:
        """The tokens the value loss counts: value_mask, or response_mask without one."""
        return self.response_mask if self.value_mask is None else self.value_mask

    def map(self, fn) -> "RolloutBatch":
        """A batch of fn(tensor) for every per-token [B, T] field (moved to a device, cast, ...); the
        rows' multi_modal_inputs are carried as they are (select rows with `select`)."""
        return RolloutBatch(**{name: None if getattr(self, name) is None else fn(getattr(self, name))
                               for name in _TOKEN_FIELDS}, multi_modal_inputs=self.multi_modal_inputs)

    def select(self, rows) -> "RolloutBatch":
        """The batch of these rows (a list or 1-D tensor of row indices), multi_modal_inputs included."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return RolloutBatch(**{name: None if getattr(self, name) is None else getattr(self, name)[index]
                               for name in _TOKEN_FIELDS},
                            multi_modal_inputs=select(self.multi_modal_inputs, index.tolist()))


_TOKEN_FIELDS = ("input_ids", "attention_mask", "response_mask", "old_values", "returns", "value_mask")


class CriticEngine(Protocol):
    """What every backend's engine is. Build one with common.engine.registry.build_engine(backend, config,
    dist): `config` an EngineConfig (common/engine/config.py, every field defaulted), `dist` the
    DistContext that common.parallel.distributed.init_distributed() returns (call it once per process, under
    torchrun or alone for a world of one). Every method is collective over the engine's ranks:
    call it on all of them, in the same order. Example (one process, CPU):

        dist = init_distributed()
        engine = build_engine("fsdp", EngineConfig(), dist)
        values = engine.compute_values(input_ids, attention_mask)      # [B, T] float32
        metrics = engine.update(RolloutBatch(input_ids, attention_mask, response_mask,
                                             old_values=shift_to_tokens(values) * response_mask,
                                             returns=returns))
        engine.export_hf("out/critic"); engine.close(); shutdown()
    """

    parallel: object
    """common.engine.mesh.ParallelMesh: the degree, coordinate and group of every parallel dimension
    (a Ray group, which drives its workers' engines from one process, has none)."""
    dp_rank: int
    dp_size: int
    dp_group: object
    """This rank's data-parallel coordinate, degree and group: give DP rank r the rows r::dp_size."""
    data_parallel_ranks: int
    """How many ranks take distinct rows: dp_size, except for a Ray group, which presents itself as
    one rank holding every row (dp_size 1) over its engines' data-parallel degree."""
    load_report: object
    """common.valuehead.LoadReport: the checkpoint's format, and which head keys were loaded or initialised."""
    scheduler: object
    """The LR schedule (a torch LRScheduler-like object with step() and get_last_lr()); update()
    steps it, a host driving forward_backward / step_optimizer steps it itself (verl's slot)."""
    version: int
    """Optimizer steps this critic has taken (every step_optimizer, update's included), saved in
    checkpoints: an asynchronous stack tags the values it computes with it and bounds their age."""

    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, multi_modal_inputs=None, *,
                       return_version: bool = False) -> torch.Tensor:
        """The critic's values, no grad: float32 [B, T] on CPU, at every position and UNSHIFTED:
        entry t is the value of the state after token t. The value the loss uses for token t (what
        RolloutBatch.old_values holds) is entry t - 1: shift_to_tokens(values) does that shift.
        return_version=True: (values, version), the version of the critic that computed them.

        input_ids: int64 [B, T]; attention_mask: [B, T] of 0/1 (right- or left-padded; padding
        positions come back as 0.0). The inputs of every method may be on any device (the engine
        takes them to the CPU first: inputs_on_host).
        multi_modal_inputs: a vision-language critic's images/videos, one dict of the processor's
        tensors (pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, second_per_grid_ts)
        or None per row, input_ids holding the expanded placeholders (common.valuehead.multimodal);
        checked against the placeholders (a mismatch names the row); a text-only critic refuses them."""
        ...

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this DP rank's share of a mini-batch (RolloutBatch: every field
        [B, T], value_mask optional; old_values and returns token-aligned). The loss counts the value-mask
        tokens (response_mask without one) and is normalised over the whole mini-batch across DP ranks. Returns common.engine.update_step.METRICS (docs/METRICS.md),
        reduced over the DP group, and router_aux_loss when engine.loss.router_aux_coef > 0."""
        ...

    # -- the step in pieces, for a host that drives its own loop and loss (verl's engine slot) -----
    def forward_backward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_fn=None,
                         multi_modal_inputs=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward (and backward) over these rows as a single packed micro-batch; the caller
        sizes them. `loss_fn(values)` gets the float32 [B, T] values (unshifted, on the device, with
        gradients) and returns a scalar loss that is backpropagated as it is: the engine averages
        gradients over the data-parallel ranks, so a loss normalised over the global batch carries a
        factor dp_size (a sequence-splitting degree's factor is the engine's own). Gradients
        accumulate until step_optimizer. loss_fn None: values only, no graph. Every data-parallel
        rank calls it the same number of times. Returns (values detached, float32 [B, T] on the CPU, on
        every rank of the DP rank's model-parallel group; the loss detached, a float32 scalar on the
        CPU, or None). multi_modal_inputs: as compute_values'."""
        ...

    def step_optimizer(self) -> float:
        """Clip (engine.optim.grad_clip) and step on the gradients forward_backward accumulated, then
        zero them; returns the global gradient norm before clipping. The LR schedule is not stepped."""
        ...

    def zero_grad(self) -> None:
        """Drop the gradients forward_backward accumulated (step_optimizer does so after stepping)."""
        ...

    def save_checkpoint(self, directory: str, extra_state: dict | None = None,
                        extra_tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Write a checkpoint (atomic: a failed save leaves no `directory`) with model, optimizer,
        schedule, version and the engine's RNG, plus `extra_state` (JSON-able, e.g. the data position)
        and `extra_tensors` (name -> tensor, e.g. a host's replay buffer, with the checkpoint,
        atomically: every rank passes the same names; a tensor equal on every rank is written once, and
        each rank's own is written where they differ)."""
        ...

    def checkpoint_bytes(self) -> int:
        """Bytes save_checkpoint would write, all ranks together (for a free-space check first)."""
        ...

    def load_checkpoint(self, directory: str) -> dict:
        """Restore a checkpoint of the same critic (any data-parallel degree; megatron: any tensor
        degree) and its version; returns its extra_state, with this rank's saved extra tensors (on
        the CPU; those each rank saved need the same number of ranks) under "extra_tensors" when there
        were any. The process's own RNG is left alone."""
        ...

    def export_hf(self, directory: str, *, max_shard_size: int | str = "5GB") -> None:
        """Write the critic as a plain HF *ForTokenClassification directory (num_labels=1; an HL-Gauss
        critic: num_labels=num_bins and its support in config.critic_value_head) (new, or
        replaced atomically), loadable with AutoModelForTokenClassification: safetensors files of
        at most max_shard_size bytes (model.safetensors, or model-0000k-of-0000n.safetensors and
        model.safetensors.index.json), each tensor written as it is gathered: no rank holds the
        whole model."""
        ...

    def export_adapter(self, directory: str) -> None:
        """Write a LoRA critic's adapter and trained head as a peft adapter directory
        (peft.PeftModel.from_pretrained loads it onto the base critic); ValueError when
        engine.lora.rank is 0."""
        ...

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameters of the whole critic (full shapes, not this rank's shards)."""
        ...

    offloaded: frozenset
    """What is off the compute device now: a subset of {"model", "grads", "optimizer"} (empty when
    resident). compute_values needs the model resident, update and the step in pieces all three."""

    def offload(self, model: bool = True, optimizer: bool = True, grads: bool = True) -> None:
        """Collective: free these parts' storages on the compute device (the storage, not a
        reference), holding their bytes in host memory (pinned on CUDA, one buffer per storage
        reused by every offload); on CUDA the freed memory goes back to the driver for other
        processes (torch.cuda.empty_cache). A part offloaded already stays so. Nothing onloads
        silently: a call that needs an offloaded part raises, naming it. save_checkpoint,
        load_checkpoint, export_hf and export_adapter onload around themselves and offload the
        same parts again after."""
        ...

    def onload(self, model: bool = True, optimizer: bool = True, grads: bool = True) -> None:
        """Collective: these offloaded parts (all by default) back, into the same tensors (FSDP's,
        DTensor's, megatron's and the optimizer's references stay valid), bit for bit; a no-op for
        a resident part."""
        ...

    def resident_bytes(self) -> dict[str, int]:
        """This rank's bytes of "model", "grads" and "optimizer" on the compute device now (0 for
        an offloaded part; the model's as the engine holds its parameters now: an FSDP2 module
        left unsharded by a forward counts its gathered ones until offload reshards it)."""
        ...

    def close(self) -> None:
        """Release the engine's groups and memory; before common.parallel.distributed.shutdown()."""
        ...


def contract_members() -> list[str]:
    """Every attribute and method of the CriticEngine contract, sorted (what the conformance suite
    asks each engine for)."""
    methods = [name for name, value in vars(CriticEngine).items() if callable(value) and not name.startswith("_")]
    return sorted(set(CriticEngine.__annotations__) | set(methods))


# The registry of backends (their specs, build_engine, register_backend) is common/engine/registry.py;
# re-exported here, where callers have always found build_engine.
from .registry import BACKENDS, build_engine  # noqa: E402,F401


def check_batch_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, vocab_size: int,
                       batch: RolloutBatch | None = None, group) -> None:
    """Token ids in the vocabulary and finite targets, checked before any forward and raised on
    every rank of `group` together: one rank raising alone would leave the others in a collective
    (gloo aborts, NCCL hangs). Call it before touching weights or optimizer."""
    valid = input_ids[attention_mask.bool()]
    bad_ids = bool(valid.numel()) and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size)
    non_finite = {}
    if batch is not None:
        response = batch.response_mask.bool()
        for name in ("returns", "old_values"):
            count = int((~torch.isfinite(getattr(batch, name)[response])).sum())
            if count:
                non_finite[name] = count
    any_ids, any_targets = all_reduce([float(bad_ids), float(bool(non_finite))], op="max", group=group)
    if any_ids:
        where = f"got [{int(valid.min())}, {int(valid.max())}] on this rank" if bad_ids else "on another rank"
        raise ValueError(f"token ids must be in [0, {vocab_size}) for this model; {where}")
    if any_targets:
        here = ", ".join(f"{name} has {count} non-finite (NaN/inf) entries on response tokens"
                         for name, count in non_finite.items())
        raise ValueError(f"{here or 'another rank has non-finite returns/old_values on response tokens'}; "
                         f"fix the rollout data (no update was made)")


def reports_version(compute_values):
    """Engine compute_values decorator: return_version=True returns (values, self.version)."""
    @functools.wraps(compute_values)
    def versioned(self, *args, return_version: bool = False, **kwargs):
        values = compute_values(self, *args, **kwargs)
        return (values, self.version) if return_version else values
    return versioned


def inputs_on_host(method):
    """Engine method decorator: every tensor argument, and every tensor of a RolloutBatch argument,
    on the CPU before the call (a CPU tensor is passed as it is). A host may pass them on any device
    (verl moves its micro-batches to the GPU first); the checks, the batching (packing, the
    micro-batches' row indices) and the loss's targets are laid out on the host, and each
    micro-batch's inputs go to the compute device when it runs."""
    @functools.wraps(method)
    def moved(self, *args, **kwargs):
        return method(self, *map(_on_host, args), **{name: _on_host(value) for name, value in kwargs.items()})
    return moved


def _on_host(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, RolloutBatch) and any(getattr(value, name) is not None
                                               and getattr(value, name).device.type != "cpu"
                                               for name in _TOKEN_FIELDS):
        return value.map(torch.Tensor.cpu)
    return value
