"""Megatron-core critic engine: the shared critic's weights in a megatron GPTModel with tensor,
pipeline, sequence, context and data parallelism, trained with megatron's schedules and optimizer
and the mini-batch-normalised clipped value loss (common.engine.update_step) as the loss closure.

Built through common.engine.build_engine("megatron", config, dist); see common/engine/__init__.py for the API.
Every rank passes its data-parallel share (`dp_rank` of `dp_size`); the tensor-, pipeline- and
context-parallel peers of a rank pass the same rows (context parallelism splits each micro-batch's
sequences over them inside the engine, inputs.py, and gathers the values back).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools

import torch
import torch.distributed as torch_dist
from .compat import fallback_warnings_off

with fallback_warnings_off():  # megatron warns at import that it falls back from Apex / TE: we mean it to
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from . import checkpoint, compat, convert, parallelize
    from . import lora as megatron_lora
    from .config import check_layout, router_aux_experts, transformer_config
    from .inputs import model_inputs
    from .value_model import build_value_model
from ...common.parallel.batching import MicroBatch
from ...common.storage.checkpoints import critic_fingerprint
from ...common.engine.config import EngineConfig, compute_dtype, resolve_mixed_precision
from ...common.parallel import kernels
from ...common.parallel.distributed import DistContext, all_reduce, one_outcome
from ...common.parallel.host_memory import large_allocations_returned
from ...common.parallel.shard_state import recv_into, recv_rows, row_pieces, send_rows
from ...common.engine import RolloutBatch, check_batch_inputs, inputs_on_host, reports_version, shift_to_tokens
from ...common.engine.images import checked_images
from ...common.learning.hl_gauss import head_values
from ...common.engine.mesh import CONTEXT, ParallelMesh, check_spans_world
from ...common.engine.registry import check_engine_config
from ...common.engine.update_step import StepStats, one_update, plan_step, step_micro_batches, whole_micro_batch
from ...common.engine.lora import base_state, injected_names, write_adapter
from ...common.engine.offload import KINDS, Offloadable, needs_resident, require_resident, resident_during
from ...common.engine import router_aux
from ...common.engine.pipeline import engine_transforms
from ...common.engine.transforms import apply_transforms, export_state_dict, folds_at_export, transform_names
from ...common.valuehead import load_critic
from ...common.valuehead.config import head_name
from ...common.valuehead.load import plan_load
from ...common.valuehead.safetensors_stream import DEFAULT_MAX_SHARD_SIZE, TensorSpec
from ...common.valuehead.save import write_critic
from ...common.valuehead.sliced import meta_critic, open_sliced

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _router_logits(router, inputs, output) -> torch.Tensor:
    """A megatron router's logits [b, s, experts] from its input [s, b, H] (the whole sequence under
    sequence parallelism: every tensor rank computes the loss whole, so the gather's backward is
    this rank's slice, as for the value head)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    logits = torch.nn.functional.linear(inputs[0], router.weight).float()
    if router.config.sequence_parallel:
        logits = gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=False)
    return logits.transpose(0, 1)


class MegatronCriticEngine(Offloadable):
    _offload_may_repoint = False  # megatron's DDP holds hooks on the parameters' gradient accumulators

    @large_allocations_returned()  # the load's freed tensors go back to the system (host_memory.py)
    def __init__(self, config: EngineConfig, dist: DistContext, *, mesh: ParallelMesh | None = None):
        """`mesh`: the engine's mesh, built with common.engine.mesh.build_mesh(engine.parallel, dist,
        backend="megatron") (which makes megatron-core's groups with it); its groups become
        megatron's parallel_state (parallelize.init_model_parallel). None: the engine builds one
        over every process, or runs on the parallel_state a host or another engine set up. The mesh
        must span every process: megatron-core 0.16's dist_checkpointing gathers its metadata over
        the default group and writes it on global rank 0 (dist_checkpointing/validation.py,
        serialization.py), so checkpoints would wait on ranks outside a sub-world."""
        config = resolve_mixed_precision(config, dist.device.type)  # built directly too, not only by build_engine
        check_engine_config("megatron", config)
        if mesh is not None:
            mesh.check_matches(config.parallel, who="the megatron engine")
            check_spans_world(mesh, who="the megatron engine",
                              why="megatron-core's dist_checkpointing gathers over the default group and writes "
                                  "on global rank 0")
        self.config = config
        self.dist = dist
        model_cfg = config.model
        # Everything that can be refused is refused before megatron creates a single group.
        self.support = config.loss.support  # an HL-Gauss head's, or None (scalar)
        hf_config = plan_load(model_cfg.path, head_prefix=model_cfg.head_prefix,
                              trust_remote_code=model_cfg.trust_remote_code, value_head=self.support).config
        self.traits = check_layout(hf_config, config, dist.world_size)  # the launcher's check, the same function
        self.aux_experts = router_aux_experts(hf_config, config)
        # The engine's own randomness (saved in checkpoints); the process's RNG is left as it was.
        self.generator = torch.Generator().manual_seed(config.seed)
        self.version = 0  # optimizer steps taken (checkpoints keep it)
        load_kwargs = dict(torch_dtype=DTYPES[model_cfg.dtype], trust_remote_code=model_cfg.trust_remote_code,
                           head_prefix=model_cfg.head_prefix, fresh_head=model_cfg.fresh_head,
                           head_init_seed=model_cfg.head_init_seed, value_head=self.support,
                           init_from_scalar_head=model_cfg.init_from_scalar_head)
        # Each rank reads only its partition's rows from the checkpoint (common.valuehead.sliced); the
        # HF critic is then a tree on meta (names, shapes and what the transforms freeze). LoRA's base
        # and adapter weights, and checkpoints that cannot be read by slices, are loaded whole.
        self._sliced = "engine.lora" if config.lora.rank else open_sliced(model_cfg.path, **load_kwargs)
        if isinstance(self._sliced, str):
            critic, self.load_report = load_critic(model_cfg.path, **load_kwargs)
        else:
            critic, self.load_report = meta_critic(self._sliced.config, self._sliced.dtype), self._sliced.report
        self.hf_config = critic.config
        # The transforms rewrite the HF critic first (pipeline order: engine.transforms, then LoRA,
        # with peft's init from the engine's seed, the same on every rank); the megatron module then
        # follows: LoRA becomes megatron's adapters (lora.py), and each megatron parameter is frozen
        # where the transforms froze its HF sources (convert.follow_frozen).
        self.transforms = engine_transforms(config)
        if self.transforms:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.seed)
                apply_transforms(critic, self.transforms)
        self.fingerprint = critic_fingerprint(critic, transform_names(self.transforms))
        self._counts = (sum(p.numel() for p in critic.parameters() if p.requires_grad),
                        sum(p.numel() for p in critic.parameters()))

        self.parallel, self._owns_mesh = parallelize.init_model_parallel(
            config.parallel, config.seed, config.collective_timeout_s, dist, mesh)
        try:
            self._build(critic, config, dist)
        except BaseException:
            self._release_mesh()
            raise

    def _build(self, critic, config: EngineConfig, dist: DistContext) -> None:
        """Everything after megatron's groups exist: coordinates, the GPTModel with the critic's
        weights, DDP, optimizer and schedule."""
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        # The rank of each (pipeline, tensor, expert) place whose copy the HF state and export take.
        self.holds_state = parallel_state.get_expert_data_parallel_rank() == 0
        self.dp_rank, self.dp_size, self.dp_group = self.parallel.dp_rank, self.parallel.dp_size, self.parallel.dp_group
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()

        self.tf_config = transformer_config(self.hf_config, config, cpu=compat.cpu_mode())
        # The layer spec (common.parallel.kernels): TransformerEngine's only on CUDA, in bf16, on
        # packed rows and without context parallelism (this engine's CP layout is the local spec's).
        self.spec = kernels.megatron_spec(compute_dtype=compute_dtype(config), packed=config.batching.packing,
                                          context=config.parallel.context, have=kernels.installed())
        use_te = self.spec.kernel == "te"
        attention = "TransformerEngine's" if use_te else "per-sequence sdpa (backends/megatron/attention.py)"
        self.load_report = dataclasses.replace(self.load_report, kernels=f"layer spec {self.spec}; attention {attention}")
        tp = config.parallel.tensor
        shapes = convert.Shapes.of(self.hf_config, tp)
        per_stage = self.hf_config.num_hidden_layers // config.parallel.pipeline
        self.layout = convert.Layout(self.tp_rank, tp, self.pp_rank * per_stage, per_stage,
                                     self.first_stage, self.last_stage, te_names=use_te,
                                     ep_rank=self.ep_rank, ep_size=config.parallel.expert)
        with torch.random.fork_rng(devices=[]):  # megatron's init draws on the global RNG; overwritten below
            model = build_value_model(self.hf_config, self.tf_config, self.traits, pre_process=self.first_stage,
                                      post_process=self.last_stage, padded_vocab=shapes.padded_vocab, use_te=use_te,
                                      first_layer=self.layout.first_layer)
        if isinstance(self._sliced, str):
            hf_state = critic.state_dict()
            read = convert.state_reader(base_state(hf_state))
            convert.check_hf_keys(base_state(hf_state), self.traits, self.hf_config.num_hidden_layers)
        else:
            read = self._sliced.read, lambda name: self._sliced.shapes[name][0]
        names = list(convert.stage_map(self.traits, self.layout))
        tensors = convert.read_partition(*read, self.hf_config, self.traits, self.layout)
        if config.lora.rank:
            megatron_lora.inject(model, config.lora, self.hf_config, tp, config.parallel.sequence_parallel)
            lora_state = megatron_lora.hf_to_megatron(hf_state, config.lora, self.layout)
            names += list(lora_state)
            tensors = itertools.chain(tensors, lora_state.items())
        if self.transforms:  # before DDP: requires_grad decides which parameters its buffers take
            convert.follow_frozen(model, critic, self.traits, self.layout)
        # The trainable parameters become shapes without memory, so that DDP's contiguous buffer
        # (distributed optimizer) is this stage's only copy of them: the weights are read into it below.
        parallelize.release_trainable(model, dist.device)
        model.to(dist.device)
        if self.traits.moe is not None:
            parallelize.mark_expert_parameters(model)
        self.model = parallelize.wrap_ddp(model, self.tf_config,
                                          distributed_optimizer=config.optim.distributed_optimizer)
        parallelize.give_storage(model)  # those DDP left outside a buffer (the plain optimizer)
        convert.load_into(model, tensors, names)  # tensor by tensor; before the optimizer copies them
        del self._sliced
        bf16 = self.tf_config.bf16
        self.optimizer = parallelize.build_optimizer(self.model, config.optim, bf16)
        self.scheduler = parallelize.LRSchedule(self.optimizer, config.optim)
        self.vocab_size = self.hf_config.vocab_size
        self._accumulating = False  # forward_backward calls since the last step_optimizer
        # Sequence parallelism splits every micro-batch's sequence over the tensor ranks.
        self._multiple = tp if config.parallel.sequence_parallel else 1
        self._cp_group = self.parallel.groups[CONTEXT] if config.parallel.context > 1 else None
        self._router_logits: list[torch.Tensor] = []  # a micro-batch's, with engine.loss.router_aux_coef

    # -- micro-batches -------------------------------------------------------------------------------
    def _micro_batches(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                       forward_only: bool = False) -> list[MicroBatch]:
        """This rank's micro-batches; the same number on every rank (data-parallel peers run their schedules in step)."""
        return step_micro_batches(input_ids, attention_mask, self.config.batching, group=self.parallel.world_group,
                                  forward_only=forward_only)

    def _forward_step(self, loss_fn, data_iterator, model):
        mb = next(data_iterator)
        self._router_logits.clear()  # (a recompute in the last backward may have added some)
        inputs = model_inputs(mb, multiple=self._multiple, cp_group=self._cp_group, device=self.dist.device)
        output = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask,
                       packed_seq_params=inputs.packed_seq_params)
        return output, functools.partial(loss_fn, mb, inputs)

    def _run(self, micro_batches: list[MicroBatch], loss_fn, *, forward_only: bool, finalize: bool = True) -> None:
        """Megatron's schedule (1F1B when pipeline > 1) over the micro-batches. `finalize`: the schedule
        ends by reducing the gradients (finalize_model_grads); False leaves them local for a later
        reduction (step_optimizer)."""
        longest = max(mb.input_ids.shape[1] for mb in micro_batches)
        finalize_func = self.tf_config.finalize_model_grads_func  # the schedule reads it from the config
        if not finalize:
            self.tf_config.finalize_model_grads_func = None
        try:
            with compat.cuda_to_cpu(), compat.step_notices_off():
                get_forward_backward_func()(
                    forward_step_func=functools.partial(self._forward_step, loss_fn),
                    data_iterator=iter(micro_batches), model=[self.model], num_microbatches=len(micro_batches),
                    seq_length=longest, micro_batch_size=max(mb.input_ids.shape[0] for mb in micro_batches),
                    forward_only=forward_only)
        finally:
            self.tf_config.finalize_model_grads_func = finalize_func

    def _share_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every pipeline stage gets the last stage's tensor (same shape everywhere)."""
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch_dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                 group=parallel_state.get_pipeline_model_parallel_group())
        return tensor

    # -- offload (common.engine.offload): parameters, DDP's grad buffers, the optimizer's state -------
    def _offload_tensors(self) -> dict[str, list[torch.Tensor]]:
        # With the distributed optimizer each parameter is a view of DDP's contiguous parameter buffer
        # (one per dtype; an fp32 optimizer's shards are views of it too, so they count as the model's).
        params = list(self.model.parameters())
        # main_grad: a view of DDP's contiguous grad buffer (the whole buffer goes with it)
        grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
        return {"model": params, "grads": grads, "optimizer": parallelize.optimizer_tensors(self.optimizer)}

    def _offload_group(self):
        return self.parallel.world_group

    # -- the engine API ------------------------------------------------------------------------------
    @reports_version
    @torch.no_grad()
    @needs_resident("model")
    @inputs_on_host
    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       multi_modal_inputs=None) -> torch.Tensor:
        """float32 [B, T] values at every position of this rank's rows (zero on padding), on CPU.
        multi_modal_inputs: refused by name (a megatron critic is text-only)."""
        check_batch_inputs(input_ids, attention_mask, vocab_size=self.vocab_size,
                           group=self.parallel.world_group)  # every rank together
        checked_images(self.hf_config, input_ids, attention_mask, multi_modal_inputs, group=self.parallel.world_group)
        self.model.eval()
        out = torch.zeros(input_ids.shape, dtype=torch.float32)

        def collect(mb, inputs, output):
            if mb.rows:
                values = head_values(inputs.crop(output), self.support)  # bin logits -> expectations
                out[mb.rows] = mb.unpack(values, input_ids.shape[1]).float().cpu()
            return output.sum() * 0.0, {}

        self._run(self._micro_batches(input_ids, attention_mask, forward_only=True), collect, forward_only=True)
        return self._share_from_last_stage(out)

    @inputs_on_host
    def accumulate_gradients(self, batch: RolloutBatch) -> StepStats:
        """Forward/backward of this rank's micro-batches through megatron's schedule, gradients
        finalised (data-parallel all-reduce etc.); returns the step's statistics (zero off the last
        pipeline stage). Gradients are those of the global mini-batch loss."""
        checked_images(self.hf_config, batch.input_ids, batch.attention_mask, batch.multi_modal_inputs,
                       group=self.parallel.world_group)
        check_batch_inputs(batch.input_ids, batch.attention_mask, vocab_size=self.vocab_size, batch=batch,
                           group=self.parallel.world_group)
        self.model.train()
        self.model.zero_grad_buffer()
        with compat.step_notices_off():
            self.optimizer.zero_grad()
        self._accumulating = False  # forward_backward's gradients, if any, are dropped with the buffer
        device = self.dist.device
        # Normalise over the whole mini-batch: every data-parallel share (TP/PP peers hold copies).
        stats = StepStats(self.config.loss, plan_step(batch, self.config.loss, self.dp_group), device)
        micro_batches = self._micro_batches(batch.input_ids, batch.attention_mask)
        aux = router_aux.StepAux.of(self.config.loss.router_aux_coef, self.aux_experts, micro_batches, self.dp_group)
        # The schedule divides each micro-batch loss by their number and DDP averages over the
        # data-parallel ranks; the loss here is already the global mean, so undo both. (Context
        # parallelism: the schedule's own x cp undoes DDP's 1 / cp, see parallelize.py.)
        scale = len(micro_batches) * self.dp_size

        def loss_fn(mb, inputs, output):
            if not mb.rows:
                return output.sum() * 0.0, {}
            # [rows, T] values, or [rows, T, num_bins] bin logits for the HL-Gauss loss
            head = inputs.crop(output if self.support is not None else output.squeeze(-1))
            values = mb.unpack(head, batch.input_ids.shape[1])
            loss = stats.micro_batch_loss(shift_to_tokens(values), batch.old_values[mb.rows].to(device),
                                          batch.returns[mb.rows].to(device), batch.loss_mask[mb.rows].to(device))
            loss = loss + aux.term(mb, [inputs.crop(logits) for logits in self._router_logits], batch.attention_mask,
                                   batch.input_ids.shape[1], stats)
            return loss * scale, {}

        with aux.capture(self.model, select=lambda name: name.endswith(".mlp.router"),
                         logits_of=_router_logits) as self._router_logits:
            self._run(micro_batches, loss_fn, forward_only=False)
        self._router_logits = []
        return stats

    @needs_resident(*KINDS)
    @inputs_on_host
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this DP rank's share of a mini-batch; returns the metrics of
        common.engine.update_step.METRICS over all data-parallel shares."""
        # Each data-parallel share counted once, by its last-stage, tensor- and context-rank-0 process;
        # every rank gets the metrics (global rank 0, which logs them, may be a first pipeline stage).
        return one_update(self, batch, dp_group=self.parallel.world_group, counts=self._counts_share())

    def _counts_share(self) -> bool:
        """The one rank of each data-parallel share whose statistics count (its peers hold copies)."""
        return self.parallel.reports_outputs

    # -- the step in pieces, for a host that drives its own loop and loss (verl's engine slot) -----
    @inputs_on_host
    def forward_backward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_fn=None,
                         multi_modal_inputs=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """common.engine.fsdp2_core.FSDP2Engine.forward_backward's contract through megatron's schedule: one
        micro-batch of these rows; loss_fn(values [B, T] float32, unshifted, with gradients) on the
        last pipeline stage, backpropagated as it is (DDP averages gradients over the data-parallel
        ranks). Returns (values, the loss or None) on every rank (tensor and pipeline peers too).
        The calls before a step_optimizer add up their gradients locally, and step_optimizer reduces
        them once (megatron's finalize_model_grads, as its schedule does at the end of a step): a
        reduction per call would count earlier calls again wherever it is not an average of equal
        values (the distributed optimizer's reduce-scatter, the sequence-parallel norms' sum)."""
        train = loss_fn is not None
        require_resident(self, KINDS if train else ("model",), "forward_backward")
        check_batch_inputs(input_ids, attention_mask, vocab_size=self.vocab_size, group=self.parallel.world_group)
        checked_images(self.hf_config, input_ids, attention_mask, multi_modal_inputs, group=self.parallel.world_group)
        self.model.train(train)
        if train and not self._accumulating:
            self.model.zero_grad_buffer()
            with compat.step_notices_off():
                self.optimizer.zero_grad()
        self._accumulating = self._accumulating or train
        micro_batches = [whole_micro_batch(input_ids, attention_mask, self.config.batching,
                                           group=self.parallel.world_group)]
        values = torch.zeros(input_ids.shape, dtype=torch.float32)
        loss_out = torch.zeros(1, dtype=torch.float32)

        def closure(mb, inputs, output):
            if not mb.rows:
                return output.sum() * 0.0, {}
            rows = mb.unpack(head_values(inputs.crop(output), self.support), input_ids.shape[1])
            full = rows.new_zeros(input_ids.shape).index_put((torch.tensor(mb.rows, device=rows.device),), rows)
            values.copy_(full.detach().float().cpu())
            if not train:
                return output.sum() * 0.0, {}
            loss = loss_fn(full)
            loss_out.copy_(loss.detach().float().cpu().reshape(1))
            return loss * len(micro_batches), {}  # the schedule divides by the micro-batch count

        self._run(micro_batches, closure, forward_only=not train, finalize=False)
        self._share_from_last_stage(values)
        self._share_from_last_stage(loss_out)
        return values, loss_out[0] if train else None

    def zero_grad(self) -> None:
        """Drop the gradients forward_backward accumulated (its next call starts from zero)."""
        self._accumulating = False

    @needs_resident(*KINDS)
    def step_optimizer(self) -> float:
        """megatron's optimizer step on the accumulated gradients (clipping included); returns the
        gradient norm before clipping. The LR schedule is stepped apart. forward_backward's
        gradients are reduced over the ranks here, once for all its calls."""
        with compat.cuda_to_cpu(), compat.step_notices_off():
            if self._accumulating:
                self.tf_config.finalize_model_grads_func([self.model])
            with self.optimizer_state_for_step():
                _, grad_norm, _ = self.optimizer.step()
            self.optimizer.zero_grad()
        self._accumulating = False
        self.version += 1
        return float(grad_norm)

    def checkpoint_bytes(self) -> int:
        """About how many bytes save_checkpoint writes (all ranks): the weights of one data-parallel
        replica (the trainable ones only, with LoRA) in their dtype, Adam's two fp32 moments of each,
        and the optimizer's fp32 copy of each where it saves one (the distributed optimizer always,
        the plain one for bf16 weights), plus 1 MiB."""
        # A tensor-parallel shard counts on its rank, a replicated tensor once (on tensor rank 0).
        # An expert's tensors count on the expert-data-parallel rank 0 of its expert rank (megatron
        # marks them allreduce=False), the others on data and context rank 0.
        params = [p for p in self.model.parameters() if (p.requires_grad or not self.transforms)
                  and (getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0)]
        dense_owner, expert_owner = self.dp_rank == 0 and self.cp_rank == 0, self.holds_state
        fp32_copy = self.config.optim.distributed_optimizer
        local = sum(p.numel() * (p.element_size() + 8 + (4 if fp32_copy or p.dtype != torch.float32 else 0))
                    for p in params if (expert_owner if not getattr(p, "allreduce", True) else dense_owner))
        (total,) = all_reduce([float(local)], group=self.parallel.world_group)
        return int(total) + 2**20

    @resident_during
    def save_checkpoint(self, directory: str, extra_state: dict | None = None,
                        extra_tensors: dict | None = None) -> None:
        checkpoint.save_checkpoint(directory, self, extra_state or {}, extra_tensors)

    @resident_during
    def load_checkpoint(self, directory: str) -> dict:
        return checkpoint.load_checkpoint(directory, self)

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full HF critic state dict on global rank 0 (None elsewhere), gathered from every shard;
        with LoRA, the HF critic's with peft's layers (`<module>.base_layer.weight`,
        `<module>.lora_A.default.weight`, ...), which common.engine.lora maps to a plain critic or an adapter."""
        own = None
        if self.holds_state:  # data- and context-parallel replicas hold the same weights
            own = ((self.pp_rank, self.tp_rank, self.ep_rank), self.layout,
                   {k: v.detach().float().cpu() if v.is_floating_point() else v
                    for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")})
        world = self.parallel.world_group
        gathered = [None] * torch_dist.get_world_size(world)
        torch_dist.gather_object(own, gathered if self.dist.is_main else None, dst=torch_dist.get_global_rank(world, 0),
                                 group=world)
        if not self.dist.is_main:
            return None
        states = {key: state for key, _, state in filter(None, gathered)}  # by (pp_rank, tp_rank, ep_rank)
        base = {key: {k: v for k, v in state.items() if not megatron_lora.is_adapter_key(k)}
                for key, state in states.items()}
        layouts = {key: layout for key, layout, _ in filter(None, gathered)}
        hf_state = convert.mcore_to_hf(base, layouts, self.hf_config, self.traits)
        if not self.config.lora.rank:
            return hf_state
        for pp_rank in sorted({key[0] for key in layouts}):
            stage = [states[(pp_rank, tp, 0)] for tp in range(self.config.parallel.tensor)]  # tensor-rank order
            hf_state.update(megatron_lora.megatron_to_hf(stage, self.config.lora, layouts[(pp_rank, 0, 0)]))
        return injected_names(hf_state)

    @resident_during
    @large_allocations_returned()
    def export_hf(self, directory: str, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        """Write the critic as a plain HF *ForTokenClassification (fp32) in safetensors files of at
        most max_shard_size bytes, one HF tensor at a time as it is gathered over the tensor and
        pipeline ranks and converted (common/valuehead/save.py: write_critic). With LoRA (folded in:
        W + alpha / r * B @ A) the whole HF state is gathered on rank 0 first."""
        if self.transforms and folds_at_export(self.transforms):
            state = self.hf_state_dict()
            plain = None if state is None else export_state_dict(state, self.transforms)
            del state
            specs = plain and [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in plain.items()]
            tensors = plain and iter(plain.items())
        else:
            plain = meta_critic(self.hf_config, torch.float32).state_dict()
            specs = [TensorSpec(name, tuple(t.shape), torch.float32) for name, t in plain.items()]
            tensors = self._iter_hf_tensors()
        with one_outcome(f"exporting {directory}", group=self.parallel.world_group,
                         timeout_s=self.config.collective_timeout_s):
            if self.dist.is_main:  # rank 0 writes; the others gather with it, and raise with its error if it fails
                write_critic(self.hf_config, directory, specs, tensors, overwrite=True, max_shard_size=max_shard_size)
            elif tensors is not None:
                for _ in tensors:
                    pass

    def _iter_hf_tensors(self):
        """The plain HF critic's tensors (fp32, on the CPU) one at a time on global rank 0, each
        gathered from its tensor-parallel shards on its pipeline stage and converted
        (convert.unshard); the embedding, split by vocabulary rows, as its row blocks (name, rows,
        first row), never whole. Every rank runs it to its end (a gather per megatron tensor)."""
        world = self.parallel.world_group
        main, dst = self.dist.is_main, torch_dist.get_global_rank(world, 0)
        # Data- and context-parallel replicas hold the same weights: each (stage, tensor, expert) place's
        # expert-data rank 0 sends; everything but the routed experts comes from expert rank 0.
        own = self.model.module.state_dict() if self.holds_state else {}
        stages = self.config.parallel.pipeline
        shapes = convert.Shapes.of(self.hf_config, self.config.parallel.tensor)
        for stage, ep_rank in itertools.product(range(stages), range(self.config.parallel.expert)):
            layout = dataclasses.replace(self.layout, tp_rank=0, first_layer=stage * self.layout.num_layers,
                                         pre_process=stage == 0, post_process=stage == stages - 1, ep_rank=ep_rank)
            for mc_name, entry in convert.stage_map(self.traits, layout).items():
                if ep_rank and entry.expert is None:
                    continue
                kind, hf_names = entry.kind, entry.hf_names
                # Who holds which shard (a few bytes each), then the shards themselves, point to point.
                holder = self.holds_state and self.pp_rank == stage and self.ep_rank == ep_rank
                mine = own[mc_name].detach().float().contiguous() if holder else None
                where = (self.tp_rank, torch_dist.get_rank(), tuple(mine.shape)) if mine is not None else None
                holders = [None] * torch_dist.get_world_size(world) if main else None
                torch_dist.gather_object(where, holders, dst=dst, group=world)
                if not main:
                    if mine is not None:
                        send_rows(mine, dst=dst, group=world)
                    continue
                if kind == "vocab":  # the embedding, the largest tensor: written by row pieces, never whole
                    for tp_rank, src, shape in sorted(filter(None, holders)):
                        pieces = (((a, mine[a:b]) for a, b in row_pieces(mine)) if src == torch_dist.get_rank() else
                                  recv_rows(shape, torch.float32, self.dist.device, src=src, group=world))
                        for start, piece in pieces:
                            first = tp_rank * shape[0] + start
                            rows = max(min(piece.shape[0], shapes.vocab - first), 0)  # the padding is dropped
                            if rows:
                                yield hf_names[0], piece[:rows].cpu().contiguous(), first
                            del piece
                    del mine
                    continue
                shards = {}
                for tp_rank, src, shape in sorted(filter(None, holders)):
                    if src == torch_dist.get_rank():
                        shards[tp_rank] = mine
                    else:
                        shards[tp_rank] = recv_into(torch.empty(shape, dtype=torch.float32, device=self.dist.device),
                                                    src=src, group=world)
                converted = convert.unshard(kind, [shards[r] for r in sorted(shards)], shapes, mc_name)
                del shards, mine
                for hf_name, tensor in zip(hf_names, converted):
                    if entry.expert is None:
                        yield hf_name, tensor.cpu().contiguous()
                    else:  # one row of the fused [experts, ...] tensor
                        yield hf_name, tensor[None].cpu().contiguous(), entry.expert
                del converted

    @resident_during
    def export_adapter(self, directory: str) -> None:
        """Write the LoRA adapter and the trained head as a peft adapter directory (common/engine/lora.py);
        engine.lora.rank must be > 0."""
        lora = self.config.lora
        if not lora.rank:
            raise ValueError("export_adapter: this critic has no LoRA adapter (engine.lora.rank=0); use export_hf")
        state = self.hf_state_dict()
        with one_outcome(f"exporting the adapter {directory}", group=self.parallel.world_group,
                         timeout_s=self.config.collective_timeout_s):
            if state is not None:
                write_adapter(directory, state, lora, head_name(self.hf_config), base_path=self.config.model.path)

    @property
    def data_parallel_ranks(self) -> int:
        """The data-parallel degree (dp_size): how many ranks take distinct rows."""
        return self.dp_size

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameters of the HF critic (layout-independent: no vocab padding)."""
        return self._counts

    def close(self) -> None:
        """Release the model, and megatron's process-global state once the last of our megatron
        engines is closed (parallelize.release_model_parallel); before the default group."""
        self._offload_state.drop()
        self.model = self.optimizer = self.scheduler = None
        self.dp_group = None  # a closed engine holds no process group (shutdown can then end them)
        # RotaryEmbedding.forward is an lru_cache keyed by the module itself: without this the cache
        # keeps the whole closed model (and its context-parallel group) alive.
        RotaryEmbedding.forward.cache_clear()
        gc.collect()
        self._release_mesh()

    def _release_mesh(self) -> None:
        """megatron's state given back (parallelize.release_model_parallel), then the mesh's groups
        forgotten when the engine built the mesh (a host's mesh stays the host's)."""
        parallelize.release_model_parallel()
        if self._owns_mesh:
            self.parallel.release()
