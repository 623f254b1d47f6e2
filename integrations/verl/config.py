"""From verl's critic configs to ours: which backend, and the EngineConfig it is built with.

verl hands an engine its model, engine and optimizer configs (`critic.model`, `critic.fsdp`,
`critic.optim` of its PPO trainer YAML). What they say is mapped onto our EngineConfig:

  critic.model.path (local_path once fetched)  engine.model.path
  critic.model.trust_remote_code               engine.model.trust_remote_code
  critic.model.enable_gradient_checkpointing   engine.gradient_checkpointing
  critic.optim.lr / weight_decay / betas       engine.optim.lr / weight_decay / betas
  critic.optim.clip_grad                       engine.optim.grad_clip
  critic.optim.lr_scheduler_type               engine.optim.lr_schedule (constant or cosine)
  critic.optim.lr_warmup_steps (or _ratio)     engine.optim.warmup_steps
  critic.optim.min_lr_ratio                    engine.optim.min_lr_ratio
  critic.optim.total_training_steps            engine.optim.total_steps
  critic.fsdp.seed                             engine.seed
  critic.fsdp.mixed_precision.param_dtype      engine.mixed_precision: bf16 -> bf16, fp32 -> none; unset
                                               (verl's default) is bf16, as verl's FSDP engine computes
  critic.fsdp.model_dtype                      engine.model.dtype: fp32 -> float32, bf16 -> bfloat16
  critic.fsdp.param_offload / optimizer_offload  our engine off the device from initialize() on; verl's phases
                                                 onload / offload it (engine.py: PhaseContext)

Our own settings on top come from CriticAdaptersEngineConfig (set `critic.fsdp._target_` to it):
`critic_adapters_backend` (fsdp | megatron | veomni) and `critic_adapters`, a mapping of our
EngineConfig keys (`{"batching": {"micro_batch_tokens": 4096}, "parallel": {"tensor": 2}}`),
which win over the mapped values. Without it the backend is fsdp with the mapped values alone.
A precision our engine has no equivalent of (fp16; a reduce_dtype or buffer_dtype other than fp32;
bf16 parameters computed in fp32) is refused by its key. verl's `critic.fsdp.dtype` is read by
verl's megatron engine only, not by its FSDP engine, and is not mapped either.
The loss is verl's own (the loss function verl passes: its value_loss and normalisation), so
`engine.loss` is not used, and `engine.loss.kind=hl_gauss` is refused.
"""

from __future__ import annotations

import dataclasses

from verl.workers.config import FSDPEngineConfig

from ...common.engine.config import EngineConfig

STRATEGY = "critic_adapters"
BACKENDS = ("fsdp", "megatron", "veomni")


@dataclasses.dataclass
class CriticAdaptersEngineConfig(FSDPEngineConfig):
    """verl's FSDP engine config (what `critic.fsdp` holds) plus the critic-adapters settings."""

    strategy: str = STRATEGY
    critic_adapters_backend: str = "fsdp"
    """Which of our backends runs the critic: fsdp, megatron or veomni."""
    critic_adapters: dict = dataclasses.field(default_factory=dict)
    """Our EngineConfig keys (common/engine/config.py), nested, over what verl's configs map to."""

    def __post_init__(self):
        # FSDPEngineConfig asserts an fsdp strategy; verl's critic config sets ours after building
        # this one, and a config built with strategy=critic_adapters is just as valid.
        strategy = self.strategy
        object.__setattr__(self, "strategy", "fsdp2")
        super().__post_init__()
        object.__setattr__(self, "strategy", strategy)
        if self.critic_adapters_backend not in BACKENDS:
            raise ValueError(f"critic.fsdp.critic_adapters_backend={self.critic_adapters_backend!r}: use one of "
                             f"{', '.join(BACKENDS)}")


def _warmup_steps(optim) -> int:
    steps = getattr(optim, "lr_warmup_steps", -1)
    if steps is not None and steps >= 0:
        return int(steps)
    total = getattr(optim, "total_training_steps", -1) or -1
    ratio = getattr(optim, "lr_warmup_steps_ratio", 0.0) or 0.0
    return int(ratio * total) if total > 0 else 0


# verl's precision names (verl.utils.torch_dtypes.PrecisionType) -> ours.
_FP32, _BF16 = ("fp32", "float32", "32", 32), ("bf16", "bfloat16")


def _precision(engine_config) -> dict:
    """critic.fsdp.model_dtype and mixed_precision as our engine.model.dtype and engine.mixed_precision.
    verl's FSDP engine computes in mixed_precision.param_dtype (bf16 when the key is missing) with
    the parameters stored in model_dtype; reduce_dtype and buffer_dtype default to fp32."""
    model_dtype = getattr(engine_config, "model_dtype", None) or "fp32"  # verl: fp32 for training
    if model_dtype not in _FP32 + _BF16:
        raise ValueError(f"critic.fsdp.model_dtype={model_dtype!r}: the critic_adapters engine stores parameters in "
                         f"fp32 or bf16")
    policy = dict(getattr(engine_config, "mixed_precision", None) or {})
    param = policy.get("param_dtype", "bf16")
    if param not in _FP32 + _BF16:
        raise ValueError(f"critic.fsdp.mixed_precision.param_dtype={param!r}: the critic_adapters engine computes in "
                         f"bf16 or fp32")
    for key, what in (("reduce_dtype", "reduces gradients in fp32"),
                      ("buffer_dtype", "has no buffer dtype of its own (buffers stay as loaded)")):
        if policy.get(key, "fp32") not in _FP32:
            raise ValueError(f"critic.fsdp.mixed_precision.{key}={policy[key]!r}: the critic_adapters engine {what}; "
                             f"leave it unset or fp32")
    if model_dtype in _BF16 and param in _FP32:
        raise ValueError(f"critic.fsdp.model_dtype={model_dtype!r} with critic.fsdp.mixed_precision.param_dtype="
                         f"{param!r}: the critic_adapters engine computes in bf16 when it stores parameters in bf16; "
                         f"set param_dtype bf16 (or model_dtype fp32 for an fp32 critic)")
    return {"model": {"dtype": "bfloat16" if model_dtype in _BF16 else "float32"},
            "mixed_precision": "bf16" if param in _BF16 else "none"}


def _mapped(model_config, engine_config, optimizer_config) -> dict:
    """What verl's configs say, as a nested dict of our EngineConfig keys."""
    schedule = getattr(optimizer_config, "lr_scheduler_type", None) or getattr(optimizer_config, "warmup_style", None) \
        or "constant"
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"critic.optim.lr_scheduler_type={schedule!r}: the critic_adapters engine runs constant or "
                         f"cosine schedules")
    total = getattr(optimizer_config, "total_training_steps", -1)
    optim = {
        "lr": float(optimizer_config.lr),
        "weight_decay": float(optimizer_config.weight_decay),
        "betas": [float(b) for b in optimizer_config.betas],
        "grad_clip": None if optimizer_config.clip_grad is None else float(optimizer_config.clip_grad),
        "lr_schedule": schedule,
        "warmup_steps": _warmup_steps(optimizer_config),
        "min_lr_ratio": float(getattr(optimizer_config, "min_lr_ratio", None) or 0.0),
        "total_steps": int(total) if total is not None and total > 0 else None,
    }
    precision = _precision(engine_config)
    return {
        "model": {"path": getattr(model_config, "local_path", None) or model_config.path,
                  "trust_remote_code": bool(getattr(model_config, "trust_remote_code", False)),
                  **precision["model"]},
        "mixed_precision": precision["mixed_precision"],
        "optim": optim,
        "gradient_checkpointing": bool(getattr(model_config, "enable_gradient_checkpointing", False)),
        "seed": int(getattr(engine_config, "seed", 0) or 0),
        # verl's Ulysses degree is ours (fsdp, veomni; megatron refuses it by key).
        "parallel": {"ulysses": int(getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1)},
    }


def engine_config_from_verl(model_config, engine_config, optimizer_config) -> tuple[str, EngineConfig]:
    """(our backend, our EngineConfig) for a verl critic; a ValueError names a key that does not fit."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    backend = getattr(engine_config, "critic_adapters_backend", "fsdp")
    ours = getattr(engine_config, "critic_adapters", None) or {}
    ours = OmegaConf.to_container(ours, resolve=True) if OmegaConf.is_config(ours) else dict(ours)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(EngineConfig), _mapped(model_config, engine_config,
                                                                               optimizer_config), ours)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or str(err).splitlines()[0]
        raise ValueError(f"critic.fsdp.critic_adapters: {key} does not fit critic-adapters' engine config "
                         f"({str(err).splitlines()[0]}); the keys are common/engine/config.py's EngineConfig fields") from None
    if config.loss.kind != "mse":
        raise ValueError(f"critic.fsdp.critic_adapters.loss.kind={config.loss.kind}: in verl's engine slot the critic "
                         f"trains with the loss verl passes (its value_loss, a squared error on the values); train an "
                         f"HL-Gauss critic with critic-adapters' own training job instead")
    return backend, config
