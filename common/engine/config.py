"""Typed configuration of a critic engine and of the training job, one dataclass per concern.

The launcher builds these from YAML plus `key=value` overrides (OmegaConf structured configs:
unknown keys are errors with a "did you mean"); library code only ever receives the dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import warnings

from ..learning.hl_gauss import HLGaussSupport, support_problem
from ..learning.loss import AGG_MODES
from ..learning.gae import OFF_MASK_REWARDS, TIMESTEP_UNITS

DTYPES = ("float32", "bfloat16")
MIXED_PRECISION = ("auto", "none", "bf16")
LR_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = "embedded:qwen2"
    """A Hugging Face model directory in any critic format, or `embedded:<family>` for a tiny random
    model built from common/testdata/configs/<family>.json (the default job uses embedded:qwen2)."""
    dtype: str = "float32"
    """Parameter (master weight) dtype: float32 or bfloat16."""
    attn_implementation: str | None = None
    """None: flash_attention_2 when available, else sdpa (or our packed sdpa when packing)."""
    trust_remote_code: bool = False
    head_prefix: str | None = None
    """The checkpoint's head is `<prefix>.weight` (+ bias), for heads under unusual names."""
    fresh_head: bool = False
    """Ignore any head in the checkpoint and start from a fresh one."""
    head_init_seed: int = 0
    init_from_scalar_head: bool = False
    """With engine.loss.kind=hl_gauss and a checkpoint whose head is scalar (an MSE critic): start
    the HL-Gauss head from it, its distribution at every token a Gaussian centred on the scalar
    head's value (common/learning/hl_gauss.py: from_scalar_head). False: a zero head (uniform over the bins,
    value = the support's centre)."""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"engine.model.dtype={self.dtype!r}: use one of {', '.join(DTYPES)}")


OPTIMIZERS = ("adamw", "muon")
STATE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    """Max global grad norm (across all shards); None disables clipping."""
    lr_schedule: str = "constant"
    """constant or cosine (after warmup, down to min_lr_ratio * lr at total_steps)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up; when > 0 it is the warm-up, whatever warmup_ratio says."""
    warmup_ratio: float | None = None
    """Warm-up as a share of total_steps (e.g. 0.1; the default job's), used while warmup_steps is 0:
    it stays in proportion when a run is short."""
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    """Optimizer steps the cosine schedule spans; the trainer fills it in from the data when None."""
    name: str = "adamw"
    """adamw, or muon: torch's Muon on the backbone's 2-D hidden matrices and AdamW on the rest
    (embeddings, norms, biases, the value head; common/engine/optimizers.py). fsdp and veomni."""
    state_dtype: str = "float32"
    """The optimizer state's dtype: float32, or bfloat16 (AdamW's moments and Muon's momentum in bf16,
    half the bytes; the arithmetic in fp32 on the fp32 parameters). fsdp and veomni."""
    offload_state: bool = False
    """Keep the optimizer state in host memory except inside the optimizer step (brought in, stepped,
    sent back; pinned and reused on CUDA): resident_bytes() shows no optimizer bytes between steps,
    and training is bit-identical to the state kept resident. Every backend."""
    distributed_optimizer: bool = True
    """The optimizer state (fp32 main weights, Adam's moments) sharded over the data-parallel ranks.
    fsdp and veomni always shard it (FSDP2 shards it with the parameters); megatron runs its
    DistributedOptimizer, or with false its plain optimizer, replicated on every data-parallel rank
    (false is megatron's knob: the other backends refuse it, common/engine/registry.py). A megatron
    checkpoint resumes only with the setting that wrote it."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"engine.optim.lr={self.lr} must be > 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"engine.optim.lr_schedule={self.lr_schedule!r}: use one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"engine.optim.warmup_steps={self.warmup_steps} must be >= 0")
        if self.name not in OPTIMIZERS:
            raise ValueError(f"engine.optim.name={self.name!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"engine.optim.state_dtype={self.state_dtype!r}: use one of {', '.join(STATE_DTYPES)}")
        if self.warmup_ratio is not None:
            if not 0.0 <= self.warmup_ratio < 1.0:
                raise ValueError(f"engine.optim.warmup_ratio={self.warmup_ratio} must be in [0, 1)")

    @property
    def warmup(self) -> int:
        """The warm-up in optimizer steps (warmup_steps, else warmup_ratio of total_steps)."""
        if self.warmup_steps or self.warmup_ratio is None:
            return self.warmup_steps
        if self.total_steps is None:
            raise ValueError(f"engine.optim.warmup_ratio={self.warmup_ratio} needs engine.optim.total_steps (the "
                             f"training job fills it in; an engine used on its own needs it set, or warmup_steps)")
        return round(self.warmup_ratio * self.total_steps)


LOSS_KINDS = ("mse", "hl_gauss")


@dataclasses.dataclass(kw_only=True, slots=True)
class HLGaussConfig:
    """The support of an HL-Gauss value head (common/learning/hl_gauss.py), used with engine.loss.kind=hl_gauss."""

    num_bins: int = 51
    min_value: float | None = None
    """Lower end of the return range (required with hl_gauss); returns below it are clamped."""
    max_value: float | None = None
    """Upper end of the return range (required with hl_gauss); returns above it are clamped."""
    sigma_ratio: float = 0.75
    """The target Gaussian's sigma in bin widths."""


@dataclasses.dataclass(kw_only=True, slots=True)
class LossConfig:
    kind: str = "mse"
    """mse: a scalar head and the clipped squared error; hl_gauss: a head of hl_gauss.num_bins logits
    trained by cross-entropy against HL-Gauss targets, its value the expectation (common/learning/hl_gauss.py)."""
    clip_range: float | None = 0.5
    """Value clip eps around the rollout's old values; None for the unclipped loss (mse only: set it
    to null with kind=hl_gauss). The standalone job's rollouts without old_values take the current
    critic's at the start of every epoch (docs/DATA.md), so the clip bounds one epoch's move."""
    agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm, normalised over
    the whole mini-batch (all ranks, all micro-batches)."""
    hl_gauss: HLGaussConfig = dataclasses.field(default_factory=HLGaussConfig)
    router_aux_coef: float = 0.0
    """Mixture-of-experts critics: the router's load-balancing loss (transformers' Switch-style
    load_balancing_loss_func over every MoE layer of a forward pass) added with this coefficient,
    averaged over the step's micro-batches. 0 (the default) trains on the value loss alone: a critic
    shares its router with no generation, and its experts' balance only costs speed."""

    def __post_init__(self):
        if self.router_aux_coef < 0:
            raise ValueError(f"engine.loss.router_aux_coef={self.router_aux_coef} must be >= 0 (0 turns it off)")
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"engine.loss.kind={self.kind!r}: use one of {', '.join(LOSS_KINDS)}")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"engine.loss.agg_mode={self.agg_mode!r}: use one of {', '.join(AGG_MODES)}")
        if self.clip_range is not None and self.clip_range <= 0:
            raise ValueError(f"engine.loss.clip_range={self.clip_range} must be > 0, or null for no clipping")
        if self.kind == "hl_gauss":  # every missing or wrong setting at once, not one per run
            h = self.hl_gauss
            problems = [problem for problem in (
                f"engine.loss.clip_range={self.clip_range} does not apply to engine.loss.kind=hl_gauss (a value clip "
                f"has no cross-entropy form): set engine.loss.clip_range=null" if self.clip_range is not None else None,
                support_problem(h.num_bins, h.min_value, h.max_value, h.sigma_ratio, prefix="engine.loss.hl_gauss."),
            ) if problem]
            if problems:
                raise ValueError("; ".join(problems))

    @property
    def support(self) -> HLGaussSupport | None:
        """The HL-Gauss support the critic's head has, or None for a scalar (mse) head."""
        if self.kind != "hl_gauss":
            return None
        h = self.hl_gauss
        return HLGaussSupport(num_bins=h.num_bins, min_value=float(h.min_value), max_value=float(h.max_value),
                              sigma_ratio=float(h.sigma_ratio))


@dataclasses.dataclass(kw_only=True, slots=True)
class BatchingConfig:
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch (per rank) in an update: micro-batches are balanced by token count."""
    forward_micro_batch_tokens: int | None = None
    """Token budget of one micro-batch in compute_values (no gradients, no activations kept for a
    backward, so it can be several times the update's); None: micro_batch_tokens."""
    micro_batch_size: int | None = None
    """Fixed number of sequences per micro-batch instead of a token budget (the classic way)."""
    packing: bool = True
    """Concatenate sequences without padding (position ids restart per sequence); attention stays
    per sequence (varlen flash-attention, else per-sequence sdpa)."""

    def __post_init__(self):
        if self.micro_batch_tokens < 1:
            raise ValueError(f"engine.batching.micro_batch_tokens={self.micro_batch_tokens} must be >= 1")
        if self.forward_micro_batch_tokens is not None and self.forward_micro_batch_tokens < 1:
            raise ValueError(f"engine.batching.forward_micro_batch_tokens={self.forward_micro_batch_tokens} must be "
                             f">= 1, or null (the update's micro_batch_tokens)")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"engine.batching.micro_batch_size={self.micro_batch_size} must be >= 1, or null")


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Model-parallel degrees; data parallel is the world size divided by their product. A degree a
    backend does not implement is refused, naming the key (common/engine/registry.py: its BackendSpec)."""

    tensor: int = 1
    """Tensor-parallel degree (Megatron)."""
    pipeline: int = 1
    """Pipeline-parallel stages (Megatron)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism over the tensor-parallel group; needs tensor > 1."""
    context: int = 1
    """Context-parallel degree (megatron): each rank holds 1/N of every sequence, in the load-balanced
    layout, and attention gathers keys and values over the group."""
    ulysses: int = 1
    """Ulysses sequence-parallel degree (fsdp, veomni): each rank holds 1/N of every micro-batch's
    tokens; attention trades sequence for heads with an all-to-all (common/parallel/ulysses.py)."""
    replicate: int = 1
    """Hybrid sharding, HSDP (fsdp, veomni): the data-parallel ranks form this many replicas, each
    sharding the critic over data / replicate ranks (x ulysses); gradients are reduce-scattered
    within a replica and all-reduced across replicas. It must divide the data-parallel degree; the
    rows, the loss and the metrics are the data-parallel ranks' as without it."""

    expert: int = 1
    """Expert-parallel degree of a mixture-of-experts critic (megatron): each rank holds 1/N of every
    MoE layer's experts and tokens travel to their experts with an all-to-all. The experts are spread
    over the data x context ranks, so N must divide that degree (and the expert count); it adds no
    dimension of its own to the world."""

    def __post_init__(self):
        for name in ("tensor", "pipeline", "context", "ulysses", "replicate", "expert"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.parallel.{name}={getattr(self, name)} must be >= 1")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("engine.parallel.sequence_parallel=true needs engine.parallel.tensor > 1 "
                             "(it splits activations across the tensor-parallel group)")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context * self.ulysses

    @property
    def min_world_size(self) -> int:
        """The fewest processes this layout runs on: one data-parallel rank per replica, and enough data
        x context ranks to spread the experts over (expert parallelism: megatron)."""
        experts_need = self.expert // math.gcd(self.expert, self.context)  # data ranks the experts need
        return self.model_parallel_size * math.lcm(self.replicate, experts_need)

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel degree of `world_size` processes; ValueError, naming the process counts
        that fit, when the model-parallel groups or the replicas do not divide them."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"{world_size} processes cannot be split into groups of engine.parallel tensor x pipeline x "
                f"context x ulysses = {self.model_parallel_size}; use a multiple of {self.min_world_size} (--nproc)")
        data = world_size // self.model_parallel_size
        if data % self.replicate:
            raise ValueError(
                f"engine.parallel.replicate={self.replicate} must divide the data-parallel degree {data} ({world_size} "
                f"processes over the model-parallel degree {self.model_parallel_size}): each replica shards the "
                f"critic over data / replicate ranks; launch a multiple of {self.min_world_size} processes (--nproc), "
                f"or lower engine.parallel.replicate")
        return data

    def describe(self, world_size: int) -> str:
        """'tensor 2 x data parallel 2' / 'data parallel 4: 2 replicas x 2 shards' for `world_size` processes."""
        named = [f"{name} {getattr(self, name)}" for name in ("tensor", "pipeline", "context", "ulysses")
                 if getattr(self, name) > 1]
        data = self.data_parallel_size(world_size)
        shards = data // self.replicate
        hsdp = f": {self.replicate} replicas x {shards} shard{'s' if shards > 1 else ''}" if self.replicate > 1 else ""
        expert = f", experts over {self.expert} ranks" if self.expert > 1 else ""
        return " x ".join([*named, f"data parallel {data}"]) + hsdp + expert


def resolve_mixed_precision(engine: "EngineConfig", device_type: str, *, honoured: bool = True) -> "EngineConfig":
    """`engine` with mixed_precision "auto" resolved for the device its ranks compute on: bf16 on CUDA,
    none elsewhere, and none on a backend that does not honour the knob (`honoured`); other values as
    they are. build_engine and the job resolve it before anything is built or written."""
    if engine.mixed_precision != "auto":
        return engine
    return dataclasses.replace(engine, mixed_precision="bf16" if device_type == "cuda" and honoured else "none")


def precision_line(requested: str, resolved: str, device_type: str) -> str:
    """The run's precision, said in its first lines: what engine.mixed_precision resolved to, and why."""
    what = "bf16 mixed precision (fp32 gradient reduction and values)" if resolved == "bf16" else "fp32"
    why = f"engine.mixed_precision=auto on {device_type}" if requested == "auto" else f"engine.mixed_precision={requested}"
    return f"precision: {what} ({why}; auto is bf16 on CUDA, fp32 on CPU)"


def compute_dtype(engine: "EngineConfig", *, mixed_precision_applies: bool = True):
    """The torch dtype the critic's matmuls and attention run in: bf16 with bf16 parameters, or
    under bf16 mixed precision where the engine applies it (`mixed_precision_applies`), else fp32
    (what common.parallel.kernels chooses kernels by)."""
    import torch

    if engine.model.dtype == "bfloat16" or (engine.mixed_precision == "bf16" and mixed_precision_applies):
        return torch.bfloat16
    return torch.float32


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """A LoRA critic (common/engine/lora.py): adapters on the backbone's projections, its base weights
    frozen, the value head trained in full."""

    rank: int = 0
    """LoRA rank r; 0 turns LoRA off (a full-parameter critic)."""
    alpha: float = 16.0
    """Scaling: the adapter adds (alpha / rank) * B @ A to each target weight."""
    dropout: float = 0.0
    """Dropout on the adapters' input (training only)."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    """The projections adapted, by their HF module names (the attention and MLP projections)."""
    adapter_path: str | None = None
    """A peft LoRA adapter directory to start from (its rank, alpha and targets must match)."""

    def __post_init__(self):
        self.target_modules = list(self.target_modules)
        if self.rank < 0:
            raise ValueError(f"engine.lora.rank={self.rank} must be >= 0 (0 turns LoRA off)")
        if self.alpha <= 0:
            raise ValueError(f"engine.lora.alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"engine.lora.dropout={self.dropout} must be in [0, 1)")
        if self.rank and not self.target_modules:
            raise ValueError("engine.lora.target_modules is empty: name the projections to adapt, e.g. [q_proj, v_proj]")
        if self.adapter_path is not None and not self.rank:
            raise ValueError(f"engine.lora.adapter_path={self.adapter_path} needs engine.lora.rank > 0 (the adapter's rank)")
        if not self.rank:  # LoRA off: a LoRA setting given anyway means the user expects a LoRA critic
            changed = [f"engine.lora.{key}={value}" for key, value, default in (
                ("target_modules", self.target_modules, list(LORA_TARGETS)), ("alpha", self.alpha, 16.0),
                ("dropout", self.dropout, 0.0)) if value != default]
            if changed:
                raise ValueError(f"{', '.join(changed)} set, but engine.lora.rank=0 turns LoRA off (a full fine-tune): "
                                 f"set engine.lora.rank > 0 (e.g. 8) for a LoRA critic, or drop the engine.lora keys")


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    mixed_precision: str = "auto"
    """auto (bf16 where the ranks compute on CUDA, as every stack trains critics on GPUs; none on CPU:
    resolve_mixed_precision), none, or bf16: bf16 parameters and compute, fp32 gradient reduction,
    fp32 values. The fsdp backend keeps the head in fp32; VeOmni applies one policy to every FSDP
    unit, so its head runs in bf16 (values are cast to fp32 after it); megatron holds every parameter
    in bf16 (its optimizer keeps fp32 main weights) and computes the head in fp32."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% more compute)."""
    cpu_offload: bool = False
    """Keep sharded parameters and optimizer state in CPU memory (FSDP2's CPUOffloadPolicy). fsdp
    applies it on every device and at any rank count (on CPU the same code runs and nothing moves);
    veomni too with 2 or more data-parallel ranks, and refuses it with one (it runs without FSDP2 there)."""
    transforms: list[str] = dataclasses.field(default_factory=list)
    """Model transforms applied between loading the critic and parallelising it, in order
    (common/engine/transforms.py: freeze_embeddings, freeze_backbone, or one a host registered)."""
    seed: int = 0
    collective_timeout_s: float = 600.0
    """How long a rank waits in a collective, or for the others to report how a save, load or export
    went, before it raises: a rank that failed cannot leave the others waiting longer. The job's
    process groups and the engine's take it (a host's own groups keep theirs)."""

    def __post_init__(self):
        self.transforms = list(self.transforms)
        if not self.collective_timeout_s > 0:
            raise ValueError(f"engine.collective_timeout_s={self.collective_timeout_s} must be > 0 (seconds)")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"engine.mixed_precision={self.mixed_precision!r}: use one of {', '.join(MIXED_PRECISION)}")


@dataclasses.dataclass(kw_only=True, slots=True)
class DataConfig:
    train_path: str = "embedded:default"
    """Rollouts as .parquet or .jsonl (schema in docs/DATA.md), or generated: embedded:default
    (single-turn) or embedded:multi_turn (agentic: turns with tool output between them)."""
    eval_path: str | None = None
    """Held-out rollouts; when null, eval_fraction of train_path is held out."""
    eval_fraction: float = 0.1
    num_rollouts: int = 2048
    """How many rollouts an embedded: set generates."""
    gamma: float = 1.0
    """Discount for GAE when the data has per-token rewards instead of returns."""
    lam_critic: float = 1.0
    """GAE lambda of the critic's returns for the same (1.0: Monte-Carlo returns, as VAPO and VC-PPO
    train the critic; common.learning.data.gae also gives the policy its own lambda)."""
    lam: float | None = None
    """Deprecated name of lam_critic (still read; it sets lam_critic)."""
    mini_batch_size: int = 64
    """Sequences per optimizer step, across all ranks."""
    rollout_batch_size: int | None = 0
    """Rollouts of one PPO iteration (verl's data.train_batch_size), for rollouts that bring no
    old_values: the job takes their old values, the centre of the value clip, from the current
    critic at the start of every rollout_batch_size rollouts of an epoch's shuffled order (null:
    once per epoch; 0, the default: 4 x mini_batch_size). A multiple of mini_batch_size where it
    matters (the job renews old values: none in the data, and a value clip); old values given in
    the data stay as given."""
    timestep_unit: str = "token"
    """GAE's timestep when the rollouts give rewards: token, or turn (each turn of the rollouts'
    turn_ids one timestep: its rewards summed, its value its first token's, its advantage and
    return on all its tokens; AReaL's gae_timestep_unit)."""
    off_mask_rewards: str = "error"
    """A non-zero reward on a token outside response_mask (a trajectory that ends on a tool output):
    error (refused, the row named), or previous (moved to the row's last response token before it).
    Never dropped."""
    truncate_to_max_positions: bool = False
    """Cut rollouts longer than the model's max_position_embeddings to that length (their tail, and
    any reward on it, is dropped) instead of refusing them."""

    def __post_init__(self):
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.mini_batch_size < 1:
            raise ValueError(f"data.mini_batch_size={self.mini_batch_size} must be >= 1")
        if self.rollout_batch_size is not None and self.rollout_batch_size < 0:
            raise ValueError(f"data.rollout_batch_size={self.rollout_batch_size} must be >= 0 (0: 4 x "
                             f"data.mini_batch_size; null: one PPO iteration per epoch)")
        if self.lam is not None:
            if self.lam_critic not in (1.0, self.lam):
                raise ValueError(f"data.lam={self.lam} and data.lam_critic={self.lam_critic} are the same setting "
                                 f"(data.lam is its deprecated name): set only data.lam_critic")
            # Folded into lam_critic, so that a saved config (and a resume check) holds one key.
            warnings.warn(f"data.lam is deprecated: it is read as data.lam_critic={self.lam}; rename the key",
                          FutureWarning, stacklevel=2)
            self.lam_critic, self.lam = self.lam, None
        if self.timestep_unit not in TIMESTEP_UNITS:
            raise ValueError(f"data.timestep_unit={self.timestep_unit!r}: use one of {', '.join(TIMESTEP_UNITS)}")
        if self.off_mask_rewards not in OFF_MASK_REWARDS:
            raise ValueError(f"data.off_mask_rewards={self.off_mask_rewards!r}: use one of "
                             f"{', '.join(OFF_MASK_REWARDS)}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam_critic <= 1.0):
            raise ValueError(f"data.gamma={self.gamma} and data.lam_critic={self.lam_critic} must be in [0, 1]")

    @property
    def iteration_rollouts(self) -> int | None:
        """Rollouts of one PPO iteration: rollout_batch_size, 4 x mini_batch_size when it is 0 (the
        default), None for one iteration per epoch."""
        return 4 * self.mini_batch_size if self.rollout_batch_size == 0 else self.rollout_batch_size


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerConfig:
    run_dir: str = "outputs/critic"
    """Everything a run writes: checkpoints/, metrics.jsonl, tensorboard/, plot, hf_export/."""
    epochs: int = 4
    """Passes over the rollouts (PPO epochs)."""
    save_every_steps: int = 0
    """Checkpoint every N optimizer steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir (an error if there is none)."""
    export_hf: bool = True
    """Write run_dir/hf_export as a plain *ForTokenClassification at the end (a LoRA critic merged),
    and, with LoRA, run_dir/hf_export_adapter as a peft adapter of engine.model.path."""
    export_max_shard_size: str = "5GB"
    """The largest safetensors file of hf_export/: bytes, or a size as transformers writes it ('5GB',
    '500MB', '2GiB'); a larger critic is written as several files with an index."""
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True

    def __post_init__(self):
        from ..valuehead.safetensors_stream import parse_size

        parse_size(self.export_max_shard_size, key="trainer.export_max_shard_size")
        if self.epochs < 1:
            raise ValueError(f"trainer.epochs={self.epochs} must be >= 1")
        if self.keep_last < 1:
            raise ValueError(f"trainer.keep_last={self.keep_last} must be >= 1")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    backend: str = "fsdp"
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)


def flat_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted config key of a dataclass tree, e.g. engine.optim.lr."""
    keys = []
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        field_type = field.default_factory if field.default_factory is not dataclasses.MISSING else None
        if isinstance(field_type, type) and dataclasses.is_dataclass(field_type):
            keys += flat_keys(field_type, name + ".")
        else:
            keys.append(name)
    return keys


# A config layer: a YAML file's path, or (where it comes from, key=value settings).
Layer = str | tuple[str, tuple[str, ...]]


def _check_override_keys(overrides, source: str) -> None:
    keys = flat_keys(TrainConfig)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"overrides must look like key=value (e.g. engine.optim.lr=1e-4); got {bad}")
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+")
        if key not in keys and not any(k.startswith(key + ".") for k in keys):
            close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; keys are: {', '.join(keys)}"
            where = "" if source == "the command line" else f" in {source}"
            raise ValueError(f"unknown config key {key!r}{where}{hint}")


def declared_backend(layers: list[Layer], overrides: list[str]) -> str | None:
    """The `backend` the last layer or override that names one says (None: none does)."""
    found = None
    for layer in layers:
        if isinstance(layer, str):
            found = _load_yaml(layer).get("backend", found)
        else:
            found = _dotlist_backend(layer[1], found)
    return _dotlist_backend(overrides, found)


def _dotlist_backend(settings, found):
    for setting in settings:
        key, _, value = setting.partition("=")
        if key.lstrip("+") == "backend":
            found = value
    return found


def load_train_config(layers: list[Layer], overrides: list[str]) -> TrainConfig:
    """Layered config -> TrainConfig: the dataclass defaults, then each layer in order (a YAML file,
    or a named list of key=value settings; a later layer wins, key by key), then `key=value`
    overrides. Bad keys and values are one-line ValueErrors naming the key, where it came from and
    what it takes."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    keys = flat_keys(TrainConfig)
    _check_override_keys(overrides, "the command line")
    sources = []
    for layer in layers:
        if isinstance(layer, str):
            sources.append((layer, lambda path=layer: _load_yaml(path)))
        else:
            _check_override_keys(layer[1], layer[0])
            sources.append((layer[0], lambda settings=layer[1]: OmegaConf.from_dotlist(list(settings))))
    if overrides:
        sources.append(("the command line", lambda: OmegaConf.from_dotlist(overrides)))
    merged = OmegaConf.structured(TrainConfig)
    for source, read in sources:
        try:
            merged = OmegaConf.merge(merged, read())
        except ConfigKeyError as err:
            key = err.full_key or str(err)
            close = difflib.get_close_matches(str(key), keys, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"unknown config key {key!r} in {source}{hint}") from None
        except OmegaConfBaseException as err:
            raise ValueError(_bad_value_message(err, source)) from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(_bad_value_message(err, "the config")) from None


def _bad_value_message(err, source: str) -> str:
    """OmegaConf's four-line validation error -> `key=value in source: expected <type> (default: ...)`."""
    key = getattr(err, "full_key", None)
    if not key:
        return f"bad config value in {source}: {str(err).splitlines()[0]}"
    value = getattr(err, "value", None)
    value = list(value) if hasattr(value, "__iter__") and not isinstance(value, str) else value
    field_type, default = _field_type_and_default(key)
    shown = f"{key}={value!r}" if value is not None else key
    shown_default = {True: "true", False: "false", None: "null"}.get(default, default) \
        if isinstance(default, (bool, type(None))) else repr(list(default) if isinstance(default, tuple) else default)
    return f"{shown} in {source}: expected {field_type} (the default is {shown_default})"


def _field_type_and_default(key: str) -> tuple[str, object]:
    """('float', 1e-05) for 'engine.optim.lr': the dataclass field's annotation and default."""
    cls, default = TrainConfig, None
    field_type = "a value of another type"
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return field_type, default
        field = fields[part]
        field_type = str(field.type).replace("tuple[float, float]", "a list of two floats").replace(
            "list[str]", "a list of strings")
        if field.default_factory is not dataclasses.MISSING:
            cls = field.default_factory
            default = cls() if not dataclasses.is_dataclass(cls) else None
        else:
            cls, default = None, field.default
    field_type = field_type.replace(" | None", ", or null")
    return re.sub(r"\bstr\b", "a string", re.sub(r"\bbool\b", "true/false", field_type)), default


def _load_yaml(path: str):
    """OmegaConf.load, with a syntax error reported as one line: file:line:column and the problem."""
    import yaml
    from omegaconf import DictConfig, OmegaConf

    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: YAML syntax error: {problem}") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"{path}: a config file holds a mapping of keys (e.g. `engine.optim.lr: 1.0e-3`), not a list")
    return OmegaConf.create(_nested(OmegaConf.to_container(loaded, resolve=False), path))


def _nested(mapping: dict, path: str, prefix: str = "") -> dict:
    """A YAML mapping with dotted keys (`engine.optim.lr: 1.0e-3`, as on the command line) spelled
    nested, at any depth; a key given both ways in one file is an error naming it."""
    out: dict = {}
    for key, value in mapping.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{path}: {prefix}{key} sets a key under {prefix}{part}, which the file also sets to "
                                 f"a value")
        leaf = parts[-1]
        value = _nested(value, path, f"{prefix}{key}.") if isinstance(value, dict) else value
        if leaf in node:
            if not (isinstance(node[leaf], dict) and isinstance(value, dict)):
                raise ValueError(f"{path}: {prefix}{key} is set twice (once dotted, once nested); keep one")
            _merge_into(node[leaf], value, path, f"{prefix}{key}.")
        else:
            node[leaf] = value
    return out


def _merge_into(target: dict, extra: dict, path: str, prefix: str) -> None:
    for key, value in extra.items():
        if key not in target:
            target[key] = value
        elif isinstance(target[key], dict) and isinstance(value, dict):
            _merge_into(target[key], value, path, f"{prefix}{key}.")
        else:
            raise ValueError(f"{path}: {prefix}{key} is set twice (once dotted, once nested); keep one")


# Keys a resumed run may change: they decide how long it runs and what it records, never what it
# computes. Every other key must match the run's saved config.yaml.
CHANGEABLE_ON_RESUME = frozenset({
    "trainer.run_dir", "trainer.resume", "trainer.epochs", "trainer.save_every_steps", "trainer.keep_last",
    "trainer.export_hf", "trainer.export_max_shard_size", "trainer.tensorboard", "trainer.plot", "trainer.progress", "engine.collective_timeout_s",
    # The parallel layout: checkpoints hold global tensors (a TP2 run resumes at TP1, an EP2 or HSDP
    # run at EP1 or plain FSDP), and the data-parallel degree already changes with --nproc.
    "engine.parallel.tensor", "engine.parallel.pipeline", "engine.parallel.sequence_parallel",
    "engine.parallel.context", "engine.parallel.ulysses", "engine.parallel.replicate", "engine.parallel.expert",
    # Both optimizers take the same steps; a megatron checkpoint names the one that wrote it, and a
    # load into the other is refused by this key (runs saved before the key existed: set it false).
    "engine.optim.distributed_optimizer",
    # Where the state lives between steps, not what it holds.
    "engine.optim.offload_state",
})


def flat_values(config: TrainConfig) -> dict:
    """{dotted key: value} of a config, e.g. {'engine.optim.lr': 1e-05, ...}."""
    out = {}

    def walk(obj, prefix):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")
            else:
                out[f"{prefix}{field.name}"] = list(value) if isinstance(value, tuple) else value

    walk(config, "")
    return out


def config_changes(old: TrainConfig, new: TrainConfig) -> list[tuple[str, object, object]]:
    """(key, old value, new value) for every key whose value differs."""
    a, b = flat_values(old), flat_values(new)
    return [(key, a[key], b[key]) for key in a if a[key] != b[key]]


def to_yaml(config: TrainConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))
