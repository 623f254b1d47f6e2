"""The engine core of the backends built on torch's FSDP2 (fsdp, veomni): the whole engine API over
an FSDP2-sharded Hugging Face critic, with small hooks for what a backend does its own way.

A backend subclasses FSDP2Engine and implements
  _build_mesh()   the ParallelMesh when none is passed in (fsdp: common.engine.mesh.build_mesh; veomni:
                  the groups of VeOmni's parallel state)
  _build()        (model, load report, optimizer, scheduler): load, transform, parallelise
and may override
  _grad_norm(max_norm)  clip and return the global grad norm (VeOmni's FSDP2 attaches its own)
  _settle()       put the model back on its sharded parameters after a forward (VeOmni)
  _export_config() a context around writing the HF export (VeOmni removes its config fields)
  _release()      free what the backend holds besides model and optimizer (VeOmni's state)

A checkpoint directory holds the DCP shards of model + optimizer, `trainer_state.pt` and
`critic_checkpoint.json` (common/storage/checkpoints.py: staging, the all-ranks-or-none commit, the
fingerprint). DCP reshards on load: a checkpoint from 2 ranks loads on 1 and back, and the two
backends read each other's checkpoints.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import gc
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..parallel import kernels, packed_attention, ulysses, varlen_attention
from ..parallel.batching import MicroBatch
from ..storage.checkpoints import (
    check_meta,
    critic_fingerprint,
    check_extra,
    check_optimizer_kind,
    optimizer_kind,
    gather_extra_tensors,
    load_trainer_state,
    save_trainer_state,
    staged_checkpoint,
    write_meta,
)
from .config import EngineConfig, resolve_mixed_precision
from ..parallel.distributed import DistContext, all_reduce, group_rank, groups_time_out_after, one_outcome
from . import RolloutBatch, check_batch_inputs, inputs_on_host, reports_version, shift_to_tokens
from .mesh import ULYSSES, ParallelMesh
from .offload import KINDS, Offloadable, needs_resident, require_resident, resident_during
from .registry import check_engine_config
from ..parallel.host_memory import large_allocations_returned
from ..parallel.shard_state import gather_full_state, iter_state_rows
from .pipeline import engine_transforms
from .transforms import export_state_dict, folds_at_export, trainable_parameters, transform_names
from . import router_aux
from .update_step import StepStats, one_update, plan_step, step_micro_batches, whole_micro_batch
from ..valuehead.safetensors_stream import DEFAULT_MAX_SHARD_SIZE, TensorSpec
from ..valuehead.save import write_critic
from ..valuehead.config import critic_class
from ..valuehead.values import compute_bin_logits, compute_values
from .images import NONE as NO_IMAGES, Images, checked_images, lay_out_images

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def attention_for(config: EngineConfig, critic_config, dtype: torch.dtype,
                  have: kernels.Installed | None = None) -> kernels.Choice:
    """The attention of an FSDP2-based engine (common.parallel.kernels decides): Ulysses
    (engine.parallel.ulysses > 1) takes our Ulysses attention, packed or padded; else an explicit
    engine.model.attn_implementation wins (a flash kernel in fp32 is refused by name); else the
    policy's choice for packed or padded rows computed in `dtype`. The attentions of our own are
    registered with transformers."""
    if config.parallel.ulysses > 1:
        ulysses.check_layout(critic_config, config, world_size=None)  # what the launcher checked (a direct build too)
        return kernels.Choice(ulysses.register(), f"Ulysses {config.parallel.ulysses}: heads split across ranks")
    if config.model.attn_implementation is not None:
        kernels.check_explicit_attention(config.model.attn_implementation, dtype)
        return kernels.Choice(config.model.attn_implementation, "engine.model.attn_implementation")
    critic_cls = critic_class(critic_config)
    text = critic_config.get_text_config()
    choice = kernels.attention(compute_dtype=dtype, packed=config.batching.packing, have=have or kernels.installed(),
                               flash_capable=critic_cls._supports_flash_attn, sdpa_capable=critic_cls._supports_sdpa,
                               softcap=getattr(text, "attn_logit_softcapping", None) is not None)
    if choice.kernel == kernels.PACKED_SDPA:
        packed_attention.register()
    elif choice.kernel == kernels.TORCH_VARLEN:
        varlen_attention.register()
    return choice


@contextlib.contextmanager
def quiet_fsdp_views():
    # FSDP2 warns that a wrapped module returns a view (the head's output): harmless here, as values
    # are never modified in place. Scoped, so the process's warning filters stay as they were.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        yield


class FSDP2Engine(Offloadable):
    backend: str = ""
    """The registry name (checkpoint meta, config checks); set by each subclass."""

    @large_allocations_returned()  # the build's freed tensors go back to the system (host_memory.py)
    def __init__(self, config: EngineConfig, dist: DistContext, *, mesh: ParallelMesh | None = None):
        config = resolve_mixed_precision(config, dist.device.type)  # built directly too, not only by build_engine
        check_engine_config(self.backend, config)
        self.config = config
        self.dist = dist
        if mesh is not None:
            mesh.check_matches(config.parallel, who=f"the {self.backend} engine")
        self._owns_mesh = mesh is None
        if mesh is None:
            with groups_time_out_after(config.collective_timeout_s):  # the groups it (or VeOmni) creates
                mesh = self._build_mesh()
        self.parallel = mesh
        self.dp_group, self.dp_rank, self.dp_size = self.parallel.dp_group, self.parallel.dp_rank, self.parallel.dp_size
        # The ranks FSDP shards over (dp x sp): checkpoints, exports and gradient averaging use them.
        self.shard_group, self.shard_size = self.parallel.shard_group, self.parallel.shard_size
        self.is_shard_main = self.parallel.shard_rank == 0
        # With HSDP (engine.parallel.replicate) the state lives on every replica's shard group:
        # checkpoints and the export's writer span them all (ParallelMesh.state_group).
        self.state_group, self.is_state_main = self.parallel.state_group, self.parallel.is_state_main
        self.sp_group = self.parallel.groups[ULYSSES] if self.parallel.sizes[ULYSSES] > 1 else None
        # The engine's own randomness (nothing in training draws from it today; saved in checkpoints).
        self.generator = torch.Generator().manual_seed(config.seed)
        self.version = 0  # optimizer steps taken (checkpoints keep it)
        try:
            self.model, self.load_report, self.optimizer, self.scheduler = self._build()
        except BaseException:
            self._release_all()
            raise
        self.vocab_size = self.model.config.get_text_config().vocab_size
        self.aux_experts = router_aux.aux_experts(
            config.loss.router_aux_coef, self.model.config,
            refuse=None if self.sp_group is None else "does not take Ulysses (each rank routes only its tokens)")
        self.fingerprint = critic_fingerprint(self.model, transform_names(engine_transforms(config)))

    # -- hooks ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _build_mesh(self) -> ParallelMesh:
        """The mesh when none is passed in."""

    @abc.abstractmethod
    def _build(self):
        """(model, load report, optimizer, scheduler): load, transform, parallelise."""

    def _grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        # clip_grad_norm_ over DTensor shards reduces across ranks: the norm of the full gradient.
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _settle(self) -> None:
        pass

    def _export_config(self):
        return contextlib.nullcontext()

    def _release(self) -> None:
        pass

    # -- offload (common.engine.offload): the storages of sharded parameters, gradients, Adam state --
    def _offload_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        optim = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        return {"model": [_local(p) for p in params], "grads": [_local(p.grad) for p in params if p.grad is not None],
                "optimizer": [_local(v) for v in optim]}

    def _offload_group(self):
        return self.parallel.world_group

    def _before_offload(self) -> None:
        for module in self.model.modules():  # unsharded parameters left from a forward are dropped, not kept
            if isinstance(module, FSDPModule):
                module.reshard()

    # -- micro-batches -------------------------------------------------------------------------------
    def _micro_batches(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                       forward_only: bool = False, images: Images = NO_IMAGES) -> list[MicroBatch]:
        """This rank's micro-batches; every DP rank runs the same number (FSDP's collectives must match).
        A vision critic's rows carry their images and multimodal positions (multimodal.lay_out)."""
        micro_batches = step_micro_batches(input_ids, attention_mask, self.config.batching, group=self.dp_group,
                                           forward_only=forward_only)
        return [lay_out_images(self.model, mb, input_ids, attention_mask, images, sharded=self._sharded_tower)
                for mb in micro_batches]

    @property
    def _sharded_tower(self) -> bool:
        """The vision tower's parameters are gathered across ranks when it runs."""
        return self.shard_size > 1 or self.parallel.replicate_size > 1

    def _images(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, multi_modal_inputs) -> Images:
        """The rows' images (multimodal.as_rows), checked against their placeholders on every DP rank
        together (multimodal.check_rows); refused under Ulysses, where only text rows run (Ulysses
        peers hold the same rows, so every rank agrees)."""
        images = checked_images(self.model.config, input_ids, attention_mask, multi_modal_inputs, group=self.dp_group)
        ulysses.check_images(self.config.parallel.ulysses, bool(images.anywhere))
        return images

    @contextlib.contextmanager
    def _replica_reduction(self, *, last: bool):
        """Around one micro-batch's forward and backward in a step. With HSDP, gradients cross the
        replicas once per step, in the last micro-batch's backward: earlier ones only reduce-scatter
        within the replica, FSDP2 summing their shards until then (FSDPModule.set_requires_all_reduce).
        The micro-batches must then give every unit's parameters gradients alike (true of a model
        whose whole graph runs each forward). A failure drops those sums, which zero_grad does not
        reach (FSDPModule.reset_iter_state). Left all-reducing: forward_backward does every call,
        as only its caller knows which is the last before step_optimizer."""
        hsdp = self.parallel.replicate_size > 1
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if hsdp else []
        for unit in units:
            unit.set_requires_all_reduce(last, recurse=False)
        try:
            yield
        except BaseException:
            if units and isinstance(self.model, FSDPModule):
                self.model.reset_iter_state()
            raise
        finally:
            for unit in units:
                unit.set_requires_all_reduce(True, recurse=False)

    @contextlib.contextmanager
    def _forward(self, mb: MicroBatch, row_length: int, *, bins: bool = False):
        """Yields (values of the micro-batch's rows laid out [len(rows), row_length], the raw model
        output); bins=True: an HL-Gauss critic's bin logits instead ([len(rows), row_length, num_bins]).
        Run the backward inside the block: under Ulysses the micro-batch's split stays active there
        (recomputed attention needs it)."""
        device = self.dist.device
        run = compute_bin_logits if bins else compute_values
        if self.sp_group is None:
            with quiet_fsdp_views():
                values = run(self.model, mb.input_ids.to(device),
                             None if mb.attention_mask is None else mb.attention_mask.to(device),
                             None if mb.position_ids is None else mb.position_ids.to(device),
                             {key: value.to(device) for key, value in (mb.model_inputs or {}).items()})
                yield mb.unpack(values, row_length), values
            return
        # Ulysses: this rank runs its slice of the columns; the values come back whole.
        split = ulysses.split_micro_batch(mb, self.sp_group)
        with ulysses.active(split), quiet_fsdp_views():
            local = run(self.model, split.input_ids.to(device), None, split.position_ids.to(device))
            values = split.gather(local)
            yield mb.unpack(values, row_length), values

    # -- the engine API ------------------------------------------------------------------------------
    @reports_version
    @torch.no_grad()
    @needs_resident("model")
    @inputs_on_host
    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       multi_modal_inputs=None) -> torch.Tensor:
        """float32 [B, T] values at every position of this rank's rows (zero on padding), on CPU;
        a vision critic's rows with their images (one dict or None per row)."""
        check_batch_inputs(input_ids, attention_mask, vocab_size=self.vocab_size, group=self.dp_group)
        images = self._images(input_ids, attention_mask, multi_modal_inputs)
        self.model.eval()
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for mb in self._micro_batches(input_ids, attention_mask, forward_only=True, images=images):
            with self._forward(mb, input_ids.shape[1]) as (values, _):
                if mb.rows:
                    out[mb.rows] = values.cpu()
        self._settle()
        return out

    @inputs_on_host
    def accumulate_gradients(self, batch: RolloutBatch) -> StepStats:
        """Forward/backward over this rank's micro-batches (the first half of update). Gradients are
        those of the global mini-batch loss; returns the step's statistics (not yet reduced)."""
        check_batch_inputs(batch.input_ids, batch.attention_mask, vocab_size=self.vocab_size, batch=batch,
                           group=self.dp_group)
        images = self._images(batch.input_ids, batch.attention_mask, batch.multi_modal_inputs)
        self.model.train()
        device = self.dist.device
        stats = StepStats(self.config.loss, plan_step(batch, self.config.loss, self.dp_group), device)
        bins = stats.support is not None  # HL-Gauss: the loss takes the bin logits
        micro_batches = self._micro_batches(batch.input_ids, batch.attention_mask, images=images)
        aux = router_aux.StepAux.of(self.config.loss.router_aux_coef, self.aux_experts, micro_batches, self.dp_group)
        for index, mb in enumerate(micro_batches):
            with self._replica_reduction(last=index == len(micro_batches) - 1), aux.capture(self.model) as logits, \
                    self._forward(mb, batch.input_ids.shape[1], bins=bins) as (values, raw):
                if not mb.rows:
                    (raw.sum() * 0.0).backward()  # keep this rank in step with the others' collectives
                    continue
                loss = stats.micro_batch_loss(shift_to_tokens(values), batch.old_values[mb.rows].to(device),
                                              batch.returns[mb.rows].to(device),
                                              batch.loss_mask[mb.rows].to(device))
                loss = loss + aux.term(mb, [part.reshape(*mb.input_ids.shape, -1) for part in logits],
                                       batch.attention_mask, batch.input_ids.shape[1], stats)
                # FSDP averages gradients over its shard ranks; the loss is already the global mean
                # (and a Ulysses rank's gradient is only its tokens' share), so undo that.
                (loss * self.parallel.gradient_ranks).backward()
        return stats

    @needs_resident(*KINDS)
    @inputs_on_host
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; returns the metrics of
        common.engine.update_step.METRICS over the data-parallel group."""
        return one_update(self, batch, dp_group=self.dp_group)

    # -- the step in pieces, for a host that drives its own loop and loss (verl's engine slot) -----
    @inputs_on_host
    def forward_backward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_fn=None,
                         multi_modal_inputs=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward (and backward) over these rows as a single packed micro-batch: the caller
        sizes them, as verl's micro-batches are. `loss_fn(values)` gets the float32 [B, T] values
        (unshifted, on the device, with gradients) and returns a scalar loss that is backpropagated
        as it is: FSDP averages gradients over the data-parallel ranks, so a loss normalised over
        the global batch carries a factor dp_size (verl's agg_loss does; the Ulysses degree's factor
        is the engine's). Gradients accumulate
        until step_optimizer. loss_fn None: values only, no graph. Every data-parallel rank calls
        it the same number of times. Returns (values, detached, float32 on the CPU; the loss, detached
        on the CPU, or None), as compute_values and megatron's return them (the engine contract).
        multi_modal_inputs: a vision critic's images, one dict or None per row."""
        train = loss_fn is not None
        require_resident(self, KINDS if train else ("model",), "forward_backward")
        check_batch_inputs(input_ids, attention_mask, vocab_size=self.vocab_size, group=self.dp_group)
        images = self._images(input_ids, attention_mask, multi_modal_inputs)
        self.model.train(train)
        mb = lay_out_images(self.model, whole_micro_batch(input_ids, attention_mask, self.config.batching,
                                                          group=self.dp_group),
                            input_ids, attention_mask, images, sharded=self._sharded_tower)
        with torch.set_grad_enabled(train), self._forward(mb, input_ids.shape[1]) as (rows, raw):
            values = rows.new_zeros(input_ids.shape).index_put((torch.tensor(mb.rows, device=rows.device),), rows) \
                if mb.rows else rows.new_zeros(input_ids.shape)
            loss = None
            if train:
                loss = loss_fn(values) if mb.rows else raw.sum() * 0.0
                (loss * (self.parallel.gradient_ranks // self.dp_size)).backward()
        if not train:
            self._settle()
        return values.detach().float().cpu(), None if loss is None else loss.detach().float().cpu()

    def zero_grad(self) -> None:
        """Drop the gradients forward_backward accumulated (step_optimizer does so after stepping)."""
        self.optimizer.zero_grad(set_to_none=True)

    @needs_resident(*KINDS)
    def step_optimizer(self) -> float:
        """Clip (engine.optim.grad_clip) and step on the accumulated gradients, then zero them;
        returns the global gradient norm before clipping. The LR schedule is stepped apart."""
        max_norm = self.config.optim.grad_clip
        norm = self._grad_norm(max_norm if max_norm is not None else float("inf"))
        if isinstance(norm, DTensor):  # when the parameters are sharded
            norm = norm.full_tensor()
        with self.optimizer_state_for_step():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return float(norm)

    def _model_state(self) -> dict:
        """The model state a checkpoint holds: every parameter, or, when transforms froze some (LoRA,
        freeze_*), only the trainable ones. Frozen weights are the ones the engine is built from
        (engine.model.path, which the fingerprint pins), so they need not be saved again."""
        state = get_model_state_dict(self.model)
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        if len(trainable) == len(list(self.model.parameters())):
            return state
        return {key: value for key, value in state.items() if key in trainable}

    @resident_during
    def save_checkpoint(self, directory: str, extra_state: dict | None = None,
                        extra_tensors: dict | None = None) -> None:
        """Write a complete checkpoint to `directory` (replacing one there only once the new one is whole)."""
        check_extra(extra_state, extra_tensors)
        self._settle()
        state = {"model": self._model_state(),
                 "optim": get_optimizer_state_dict(self.model, self.optimizer)}
        main = self.is_state_main
        # Every rank's extra tensors to the writer (state_group spans every rank of an FSDP2 engine).
        extra = gather_extra_tensors(extra_tensors, group=self.state_group)
        with staged_checkpoint(directory, is_main=main, group=self.state_group,
                               timeout_s=self.config.collective_timeout_s) as staging:
            dcp.save(state, checkpoint_id=staging, process_group=self.state_group)  # the ranks FSDP shards over
            if main:
                save_trainer_state(staging, self, extra_state or {}, extra)
                write_meta(staging, self.fingerprint, world_size=self.shard_size, backend=self.backend,
                           optimizer_kind=optimizer_kind(self.config.optim))

    @resident_during
    def load_checkpoint(self, directory: str) -> dict:
        """Restore model, optimizer, scheduler and the engine's RNG in place; returns the saved extra state."""
        self._settle()
        # Each rank reads the checkpoint's files itself: all agree on what they found before the
        # collective load, and on how the load went after it (common.parallel.distributed.one_outcome).
        agreed = functools.partial(one_outcome, group=self.state_group, timeout_s=self.config.collective_timeout_s)
        with agreed(f"loading checkpoint {directory}"):
            meta = check_meta(directory, self.fingerprint)
            if meta.get("backend") == "megatron":
                raise ValueError(f"{directory} was written by the megatron backend (dist_checkpointing shards); "
                                 f"resume it with backend=megatron, or start a new run from its hf_export")
            check_optimizer_kind(directory, meta, self.config.optim)
        with agreed(f"loading checkpoint {directory}"):
            state = {"model": self._model_state(),
                     "optim": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(state, checkpoint_id=directory, process_group=self.state_group)
            set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            extra = load_trainer_state(directory, self, rank=group_rank(self.state_group),
                                       world_size=self.parallel.world_size)
        return extra

    def checkpoint_bytes(self) -> int:
        """About how many bytes save_checkpoint writes (all ranks): model and optimizer state, plus 1 MiB."""
        tensors = trainable_parameters(self.model)  # what _model_state saves
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        shards = [_local(t) for t in tensors]
        local = sum(s.numel() * s.element_size() for s in shards)
        (total,) = all_reduce([float(local)], group=self.shard_group)
        return int(total) + 2**20

    def _full_state(self) -> dict | None:
        """The full (unsharded) model state dict on the CPU of the shard group's first rank, None
        elsewhere (collective over the shard group, tensor by tensor: common.parallel.shard_state)."""
        self._settle()
        return gather_full_state(self.model, group=self.shard_group)

    @resident_during
    @large_allocations_returned()
    def export_hf(self, directory: str, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        """Write the plain critic (fp32 master weights) as safetensors files of at most max_shard_size
        bytes, each rank's row shards sent to the writing rank and written in place one at a time
        (common/valuehead/save.py: write_critic; shard_state.iter_state_rows): no rank holds more
        than a shard of one tensor beyond its own. Transforms that fold tensors back into the plain
        critic (LoRA) gather the whole state on the first rank first."""
        transforms = engine_transforms(self.config)
        if folds_at_export(transforms):
            full = self._full_state()
            plain = None if full is None else export_state_dict(full, transforms)
            del full
            specs = plain and [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in plain.items()]
            tensors = plain and iter(plain.items())
        else:
            self._settle()
            specs = self._export_specs()
            tensors = iter_state_rows(self.model, group=self.shard_group)
        # Each replica's shard group gathers; the first rank of the whole state writes.
        with one_outcome(f"exporting {directory}", group=self.state_group, timeout_s=self.config.collective_timeout_s):
            if self.is_state_main:  # the others gather with it, and raise with its error if it fails
                with self._export_config():
                    write_critic(self.model.config, directory, specs, tensors, overwrite=True,
                                 max_shard_size=max_shard_size)
            elif tensors is not None:
                for _ in tensors:
                    pass

    def _export_specs(self) -> list[TensorSpec]:
        """Names, full shapes and dtypes of the plain critic's tensors (no data)."""
        state = get_model_state_dict(self.model)
        return [TensorSpec(name, tuple(v.shape), v.dtype) for name, v in state.items()]

    @resident_during
    def export_adapter(self, directory: str) -> None:
        """Write the LoRA adapter and the trained head as a peft adapter directory (common/engine/lora.py),
        which peft.PeftModel.from_pretrained loads onto the base critic; engine.lora.rank must be > 0."""
        lora = self.config.lora
        if not lora.rank:
            raise ValueError("export_adapter: this critic has no LoRA adapter (engine.lora.rank=0); use export_hf")
        from .lora import write_adapter
        from ..valuehead.config import head_name

        full = self._full_state()
        with one_outcome(f"exporting the adapter {directory}", group=self.state_group,
                         timeout_s=self.config.collective_timeout_s):
            if self.is_state_main:
                write_adapter(directory, full, lora, head_name(self.model.config), base_path=self.config.model.path)

    @property
    def data_parallel_ranks(self) -> int:
        """The data-parallel degree (dp_size): how many ranks take distinct rows."""
        return self.dp_size

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameters of the whole critic (full shapes, not this rank's shards)."""
        params = list(self.model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def close(self) -> None:
        """Release the sharded model and optimizer (and the mesh, when the engine built it). Call
        before destroying the process group (common.parallel.distributed.shutdown)."""
        self._offload_state.drop()
        self.model = self.optimizer = self.scheduler = None
        self.dp_group = self.shard_group = self.state_group = self.sp_group = None  # a closed engine holds no process group
        self._release_all()

    def _release_all(self) -> None:
        gc.collect()  # FSDP state and autograd graphs reference the mesh's groups
        self._release()
        if self._owns_mesh:
            self.parallel.release()
