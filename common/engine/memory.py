"""What one rank of a critic engine holds, from the config alone (no weight is read): parameters,
gradients and optimizer state as `engine.resident_bytes()` counts them (the bytes of the storages), and
the activations a step saves for its backward, estimated.

  critic shapes: the critic built on the meta device, the engine's transforms (LoRA) applied, as the
                 build pipeline does (common/engine/pipeline.py) -> every parameter's shape, dtype and
                 whether it trains
  FSDP2 (fsdp, veomni): each parameter is split by rows over the shard group (data x context x
                 ulysses, divided by replicate under HSDP); every rank's storage holds ceil(rows / shard)
                 rows (FSDP2 pads the last shards), so the first rank's shard is the largest:
                   parameters  padded shards, in engine.model.dtype
                   gradients   padded shards of the trainable parameters (held from the backward to the
                               step; resident_bytes() after forward_backward)
                   optimizer   the first rank's (unpadded) shards: AdamW's two moments in
                               engine.optim.state_dtype plus a 4-byte step per parameter; Muon a momentum
                               per backbone matrix (common.engine.optimizers.muon_parameters) and AdamW's
                               state for the rest; 0 with engine.optim.offload_state (it lives on the host)
  activations: what one micro-batch at the token budget saves for its backward, counted over a forward on
                 the meta device (common.engine.saved_bytes; a fused attention's saved tensors), where
                 Megatron-LM's theoretical_memory_usage writes the same count as a formula per layer;
                 with gradient checkpointing, what torch's non-reentrant checkpoint keeps; a backend with
                 modeling of its own corrects it (BackendSpec.activation_memory: megatron's).

Each backend's parameter, gradient and optimizer count is its BackendSpec.state_memory: the FSDP2 one
here, megatron's (DDP's padded buffers, the distributed optimizer's shards, fp32 main weights) in
backends/megatron/memory.py. Exact: tests compare them with resident_bytes() at several layouts.
"""

from __future__ import annotations

import dataclasses
import math

import torch

UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


@dataclasses.dataclass(frozen=True, slots=True)
class RankMemory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int | None
    """At engine.batching.micro_batch_tokens, with the config's gradient checkpointing (None: not estimated)."""
    activations_other: int | None
    """The same with gradient checkpointing the other way."""
    checkpointing: bool

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + (self.activations or 0)


def size(nbytes: int) -> str:
    """'1.50 GiB', '3.0 MiB', '12 B'."""
    for unit, scale in UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """'80GB' / '80GiB' / '80 GB' -> bytes (GB read as GiB: device memory is quoted in binary units)."""
    import re

    found = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.I)
    if not found:
        raise ValueError(f"--device-memory {text!r}: give a size such as 80GB or 24GiB")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[found.group(2).upper()]
    return int(float(found.group(1)) * scale)


def meta_critic(engine_config, critic_config) -> torch.nn.Module:
    """The critic as the engine builds it, on the meta device: the family's class in engine.model.dtype, the
    engine's transforms (LoRA: adapters added, the base frozen) applied."""
    from ..valuehead.config import critic_class
    from .pipeline import engine_transforms
    from .transforms import apply_transforms

    dtype = getattr(torch, engine_config.model.dtype)
    with torch.device("meta"):
        model = critic_class(critic_config)(critic_config).to(dtype)
    return apply_transforms(model, engine_transforms(engine_config))


def _rows_on_rank(rows: int, shard: int, rank: int) -> tuple[int, int]:
    """(the rows of `rank`'s shard, the rows its storage holds, padded) of a parameter split over `shard` ranks."""
    per = math.ceil(rows / shard) if rows else 0
    own = max(0, min(per, rows - rank * per))
    return own, per


def fsdp2_state_bytes(model: torch.nn.Module, optim, shard: int, rank: int = 0) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes of `rank` of an FSDP2 shard group of `shard` ranks."""
    from .optimizers import muon_parameters

    muon = set(muon_parameters(model)) if optim.name == "muon" else set()
    state = torch.finfo(getattr(torch, optim.state_dtype)).bits // 8
    params = grads = optimizer = 0
    for name, p in model.named_parameters():
        rows = p.shape[0] if p.dim() else 1
        rest = p.numel() // rows if rows else 0
        own, padded = _rows_on_rank(rows, shard, rank) if shard > 1 else (rows, rows)
        params += padded * rest * p.element_size()
        if not p.requires_grad:
            continue
        grads += padded * rest * p.element_size()
        if name in muon:
            optimizer += own * rest * state  # the momentum buffer
        else:
            optimizer += 2 * own * rest * state + 4  # exp_avg, exp_avg_sq, and the fp32 step
    if optim.offload_state:
        optimizer = 0
    return params, grads, optimizer


def fsdp2_shard_degree(parallel, world_size: int) -> int:
    """The ranks FSDP2 splits each parameter over: data x context x ulysses, over replicate under HSDP."""
    from .mesh import CONTEXT, DATA, ULYSSES, mesh_sizes

    sizes = mesh_sizes(parallel, world_size)
    return sizes[DATA] * sizes[CONTEXT] * sizes[ULYSSES] // parallel.replicate


class _FusedAttention(torch.autograd.Function):
    """The tensors a fused attention kernel (flash, or sdpa's fused CPU and CUDA kernels) keeps for its
    backward: q, k and v as given (grouped K/V heads not repeated), the output and the log-sum-exp. On
    the meta device sdpa would take its math path and keep the T x T weights, which no engine does."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = torch.empty_like(query)
        ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - shapes only, never differentiated
        raise RuntimeError("the meta-device attention only counts what a step keeps")


def _meta_attention(module, query, key, value, attention_mask=None, **kwargs):
    return _FusedAttention.apply(query, key, value).transpose(1, 2), None


META_ATTENTION = "critic_meta_attention"


def activation_bytes(model: torch.nn.Module, tokens: int, *, checkpointing: bool) -> int | None:
    """Bytes one micro-batch of `tokens` tokens keeps for the backward, counted (common.engine.saved_bytes)
    over a forward of one row of that length through `model` on the meta device with a fused attention's
    saved tensors: every layer's, or with gradient checkpointing the layers' inputs (what torch's
    non-reentrant checkpoint keeps). None when the family's forward does not run on the meta device
    (qwen3_moe's grouped expert matmul refuses it); only the meta device's refusals (RuntimeError,
    NotImplementedError) mean that, any other error is a bug and propagates."""
    from transformers import AttentionInterface

    from .saved_bytes import SavedForBackward

    AttentionInterface.register(META_ATTENTION, _meta_attention)  # a dict update: idempotent
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                         "_attn_implementation")}
    before = {key: config._attn_implementation for key, config in configs.items()}
    was_training = model.training
    try:
        for config in configs.values():
            config._attn_implementation = META_ATTENTION
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        positions = torch.arange(tokens, device="meta")[None]
        with SavedForBackward(model) as saved:
            model(input_ids=ids, position_ids=positions, use_cache=False)
        return saved.peak
    except (RuntimeError, NotImplementedError):
        return None
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]
        if checkpointing:
            model.gradient_checkpointing_disable()
        model.train(was_training)


def fsdp2_state_memory(engine, critic_config, world_size: int, rank: int | None = 0) -> tuple[int, int, int]:
    """BackendSpec.state_memory of the FSDP2 backends (fsdp, veomni): the first rank of a shard group
    holds the most (rank None)."""
    shard = fsdp2_shard_degree(engine.parallel, world_size)
    return fsdp2_state_bytes(meta_critic(engine, critic_config), engine.optim, shard, (rank or 0) % shard)


def state_memory(backend: str, engine, critic_config, world_size: int, rank: int | None = 0
                 ) -> tuple[int, int, int] | None:
    """(parameters, gradients, optimizer) bytes of `rank` (None: the rank holding the most) of an engine of
    `backend` with EngineConfig `engine` on `world_size` ranks, as its resident_bytes() reports them once a
    backward has run (None: a backend whose BackendSpec has no state_memory)."""
    from .registry import BACKENDS, resolve

    spec = BACKENDS.get(backend)
    if spec is None or spec.state_memory is None:
        return None
    try:
        count = resolve(spec.state_memory)
    except ImportError:  # the backend is not part of this build (a Bazel target, a vendored subset)
        return None
    return count(engine, critic_config, world_size, rank)


def rank_memory(config, critic_config, world_size: int) -> RankMemory | None:
    """The memory of the rank holding the most for `config` (a TrainConfig) on `world_size` ranks; None
    for a backend whose state is not computed here."""
    engine = config.engine
    state = state_memory(config.backend, engine, critic_config, world_size, None)
    if state is None:
        return None
    compute = engine.model if engine.mixed_precision != "bf16" else dataclasses.replace(engine.model, dtype="bfloat16")
    model = meta_critic(dataclasses.replace(engine, model=compute), critic_config)  # bf16: FSDP2 computes in bf16
    tokens = math.ceil(engine.batching.micro_batch_tokens / (engine.parallel.context * engine.parallel.ulysses))
    checkpointing = bool(engine.gradient_checkpointing)
    from .registry import BACKENDS, resolve

    backend_count = BACKENDS[config.backend].activation_memory

    def activations(with_checkpointing: bool) -> int | None:
        if backend_count is None:
            return activation_bytes(model, tokens, checkpointing=with_checkpointing)
        return resolve(backend_count)(engine, model, tokens, with_checkpointing)

    return RankMemory(*state, activations(checkpointing), activations(not checkpointing), checkpointing)


def plan_memory_line(plan, device_memory: int | None) -> str:
    """The job plan's `memory per rank:` line (common.job.plan.JobPlan)."""
    memory = rank_memory(plan.config, plan.model.critic_config, plan.processes)
    return memory_line(memory, plan.config.backend, device_memory)


def local_device_memory() -> int | None:
    """The local CUDA device's memory, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def memory_line(memory: RankMemory | None, backend: str, device_memory: int | None) -> str:
    """'memory per rank: parameters 1.23 GiB, gradients ..., optimizer ..., activations ... (...), total ...;
    fits a device of 80.00 GiB' (or 'does not fit')."""
    if memory is None:
        return f"memory per rank: not computed for the {backend} backend yet"
    other = "without" if memory.checkpointing else "with"
    activations = ("activations not estimated (the family's forward does not run on the meta device)"
                   if memory.activations is None
                   else f"activations {size(memory.activations)} ({size(memory.activations_other)} {other} gradient "
                        f"checkpointing)")
    line = (f"memory per rank: parameters {size(memory.parameters)}, gradients {size(memory.gradients)}, optimizer "
            f"{size(memory.optimizer)}, {activations}, total {size(memory.total)}")
    if device_memory is None:
        return line + "; no device to compare with (--device-memory SIZE)"
    verdict = "fits" if memory.total <= device_memory else "does not fit"
    return f"{line}; {verdict} a device of {size(device_memory)}"
