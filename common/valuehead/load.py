"""load_critic: any critic checkpoint format -> a `*ForTokenClassification(num_labels=1)` critic.

The backbone is loaded by transformers' own from_pretrained (sharding, dtype, key conversions),
with the detected head renamed to `score.*` through `key_mapping`. Every key transformers reports
missing or unexpected is then checked against what the detected format allows, so a head under a
name we do not know is an error, never a silently re-initialised head.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from ._quiet import quiet_transformers
from .attention import per_tower, select_attn_implementation
from .checkpoint_files import CheckpointIndex, index_checkpoint, load_tensors
from ..learning.hl_gauss import HLGaussSupport, describe, from_scalar_head, support_of
from .config import DECLARED_HEAD, critic_class, critic_config, critic_head, head_name, install_value_head, text_hidden_size
from .errors import CriticLoadError
from .experts import describe_experts
from .formats import Detection, detect_format
from ..learning.hl_gauss import CONFIG_KEY


@dataclasses.dataclass(slots=True)
class LoadReport:
    """What load_critic found and did; `str(report)` is a readable summary."""

    path: str
    format: str
    """Detected source format, e.g. 'trl-value-head' or 'hf-token-classification'."""
    description: str
    storage: str
    """'single-file', 'sharded' or 'sidecar' (where the head was stored)."""
    family: str
    """The config's model_type."""
    critic_class: str
    head: str
    """'loaded' when the head weights came from the checkpoint, 'initialized' for a fresh head,
    'from-scalar' for an HL-Gauss head started from the checkpoint's scalar head."""
    head_source: list[str]
    """Checkpoint tensors the head was read from (empty for a fresh head)."""
    bias: str
    """'loaded', 'zero' (the format has no bias; values unchanged) or 'initialized'."""
    attn_implementation: str
    dtype: str
    missing_keys: list[str]
    """Critic tensors the checkpoint did not provide (and were initialised)."""
    unexpected_keys: list[str]
    """Checkpoint tensors the critic does not use (e.g. a causal LM's lm_head)."""
    value_head: str = "a scalar head"
    """The kind of head the critic has (common/learning/hl_gauss.py: describe)."""
    experts: str | None = None
    """A mixture-of-experts backbone's experts (common/valuehead/experts.py), None for a dense one."""
    kernels: str | None = None
    """What an engine runs the critic with and why (common.parallel.kernels); None from load_critic."""

    def __str__(self) -> str:
        lines = [
            f"critic loaded from {self.path}",
            f"  format       {self.format} ({self.description}; {self.storage})",
            f"  family       {self.family} -> {self.critic_class} [{self.dtype}, attention {self.attn_implementation}]",
            f"  head         {self.head}" + (f" from {', '.join(self.head_source)}" if self.head_source else "")
            + f" ({self.value_head})",
            f"  head bias    {self.bias}",
        ]
        if self.experts:
            lines.append(f"  experts      {self.experts}")
        if self.kernels:
            lines.append(f"  kernels      {self.kernels}")
        if self.missing_keys:
            lines.append(f"  initialised  {', '.join(self.missing_keys)}")
        if self.unexpected_keys:
            lines.append(f"  ignored      {', '.join(self.unexpected_keys)}")
        return "\n".join(lines)


def read_config_dict(path: str) -> dict:
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise CriticLoadError(f"{path} does not exist; pass a Hugging Face model directory (the folder that holds "
                              f"config.json)")
    if os.path.isfile(path):
        folder = os.path.dirname(os.path.abspath(path))
        raise CriticLoadError(f"{path} is a file; pass the model directory that holds it ({folder}), not a file in it")
    if not os.path.isfile(config_file):
        raise CriticLoadError(f"{path} has no config.json; a critic checkpoint is a Hugging Face model directory")
    with open(config_file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise CriticLoadError(f"{config_file} is not valid JSON ({err})") from err


def load_hf_config(path: str, config_dict: dict, trust_remote_code: bool) -> PretrainedConfig:
    """AutoConfig for `path`, with errors that say what to do about unknown or custom model types."""
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        if "auto_map" in config_dict and not trust_remote_code:
            raise CriticLoadError(
                f"{path} needs its own modelling code (config.json has auto_map for model_type "
                f"{model_type!r}); pass trust_remote_code=True (CLI: --trust-remote-code) if you trust it"
            )
        if "auto_map" not in config_dict:
            raise CriticLoadError(
                f"unknown model_type {model_type!r} in {path}/config.json: this transformers has no such "
                f"model family. Check the checkpoint, or upgrade transformers if the family is newer."
            )
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def output_projection_keys(index: CheckpointIndex, vocab_size: int, prefix: str = "") -> set[str]:
    """Top-level vocab-sized tensors: a causal LM's output projection (lm_head, GPT-NeoX's embed_out),
    named as the critic sees them (`prefix` removed).

    A critic never uses them, so they are the only checkpoint tensors it may silently leave out.
    """
    names = {key.removeprefix(prefix): info for key, info in index.tensors.items()}
    return {
        key for key, info in names.items()
        if key.startswith("lm_head.") or (key.count(".") == 1 and info.shape[:1] == (vocab_size,))
    }


def _allowed_missing(detection: Detection, head: str, fresh_head: bool) -> set[str]:
    """Critic keys the detected format may leave missing (then initialised)."""
    weight, bias = f"{head}.weight", f"{head}.bias"
    if fresh_head or detection.head_weight is None or detection.head_file:
        missing = {weight, bias}
    else:
        missing = {bias} if detection.head_bias is None else set()
    return missing


def _check_loading_info(path: str, info: dict, detection: Detection, head: str, fresh_head: bool,
                        projections: set[str]) -> tuple[list[str], list[str]]:
    allowed_missing = _allowed_missing(detection, head, fresh_head)
    if info["mismatched_keys"]:
        raise CriticLoadError(
            f"{path}: tensor shapes differ from what its config.json describes: "
            f"{sorted(map(str, info['mismatched_keys']))[:8]}. The weights and config come from different models."
        )
    missing = sorted(info["missing_keys"])
    bad_missing = [k for k in missing if k not in allowed_missing]
    if bad_missing:
        raise CriticLoadError(
            f"{path} lacks {len(bad_missing)} backbone tensors the critic needs (e.g. {bad_missing[:5]}); "
            f"the checkpoint is incomplete or belongs to a different model family"
        )
    unexpected = sorted(info["unexpected_keys"])
    # A fresh head was asked for: whatever else the checkpoint holds is ignored (and reported).
    bad_unexpected = [] if fresh_head else [k for k in unexpected if k not in projections]
    if bad_unexpected:
        raise CriticLoadError(
            f"{path} ({detection.format}) holds tensors no known critic layout uses: {bad_unexpected[:8]}. "
            f"If one of them is the value head, name it with head_prefix='<prefix>' (CLI: --head-prefix); "
            f"to ignore them and start from a fresh head, pass fresh_head=True (CLI: --fresh-head)."
        )
    return missing, unexpected


@torch.no_grad()
def head_tensors(head: str, weight_shape: tuple[int, ...], config, path: str, index: CheckpointIndex,
                 detection: Detection, *, fresh_head: bool, head_changes: bool, scalar_source: Detection | None,
                 head_init_seed: int) -> tuple[dict[str, torch.Tensor], tuple[str, str]]:
    """({critic key: tensor} for the head tensors load_critic sets after from_pretrained, (head, bias)
    as the LoadReport says them). `detection` is the one from_pretrained loaded with (head_file None
    for a new head); `scalar_source` the checkpoint's scalar head an HL-Gauss head starts from.
      - from a scalar head: the HL-Gauss head centred on it (hl_gauss.from_scalar_head);
      - another kind of head, not fresh: zero weight and bias (a uniform distribution: every value
        is the support's centre; the same on every rank with no seed);
      - fresh, or none stored: a seeded normal init (every rank and run builds the same one);
      - a sidecar head: read from its file; a format without a bias: zero bias."""
    weight_key, bias_key = f"{head}.weight", f"{head}.bias"
    outputs = weight_shape[0]
    if scalar_source is not None:
        keys = scalar_source.head_keys
        if scalar_source.head_file is not None:
            stored = load_tensors(path, scalar_source.head_file, keys)
        else:
            stored = {key: load_tensors(path, index.tensors[key].file, [key])[key] for key in keys}
        bias = stored[scalar_source.head_bias] if scalar_source.head_bias is not None else None
        weight, bias = from_scalar_head(stored[scalar_source.head_weight], bias, support_of(config))
        return {weight_key: weight, bias_key: bias}, ("from-scalar", "from-scalar")
    if head_changes and not fresh_head:
        return {weight_key: torch.zeros(weight_shape), bias_key: torch.zeros(outputs)}, ("initialized", "zero")
    if fresh_head or detection.head_weight is None:
        generator = torch.Generator().manual_seed(head_init_seed)
        std = config.get_text_config().initializer_range
        weight = torch.empty(weight_shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        return {weight_key: weight, bias_key: torch.zeros(outputs)}, ("initialized", "initialized")
    out = {}
    if detection.head_file is not None:
        stored = load_tensors(path, detection.head_file, detection.head_keys)
        out[weight_key] = stored[detection.head_weight]
        if detection.head_bias is not None:
            out[bias_key] = stored[detection.head_bias]
    if detection.head_bias is None:
        out[bias_key] = torch.zeros(outputs)
        return out, ("loaded", "zero")
    return out, ("loaded", "loaded")


def _shape_mismatch_message(path: str, index: CheckpointIndex, model_cls, config) -> str:
    """Which checkpoint tensors (and files) have shapes the model built from config.json does not."""
    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in model_cls(config).state_dict().items()}
    wrong = [f"{key} is {list(info.shape)} in {info.file}, the model needs {list(expected[key])}"
             for key, info in sorted(index.tensors.items()) if key in expected and expected[key] != info.shape]
    files = sorted({info.file for info in index.tensors.values()})
    detail = "; ".join(wrong[:5]) if wrong else f"in {', '.join(files)}"
    return (f"{path}: tensor shapes differ from what its config.json describes ({detail}). The weights and config "
            f"come from different models, or a file's header is wrong")


_FINITE_PIECE = 1 << 22  # elements checked at a time


def count_nonfinite(tensor: torch.Tensor) -> int:
    """NaN/inf values in `tensor`, counted a piece at a time: torch.isfinite on a whole 150k-token
    embedding allocates its absolute value and two masks, ~2x the tensor, at the moment the load
    holds the most."""
    flat = tensor.detach().reshape(-1)
    return sum(int((~torch.isfinite(piece)).sum()) for piece in flat.split(_FINITE_PIECE))


@torch.no_grad()
def _check_finite(model, path: str) -> None:
    """Refuse NaN/inf in the head, the embeddings and every 1-D tensor (norms, biases): a corrupt
    checkpoint then fails here, naming the tensor, instead of as NaN values later. The large
    matrices are left unchecked to keep loading cheap."""
    embeddings = model.get_input_embeddings().weight
    for name, tensor in model.named_parameters():
        if tensor.dim() > 1 and tensor is not embeddings and tensor is not critic_head(model).weight:
            continue
        if tensor.is_meta:  # built under a meta-device context (verl's ranks > 0): nothing to check
            continue
        bad = count_nonfinite(tensor)
        if bad:
            raise CriticLoadError(f"{path}: tensor {name} holds {bad} NaN/inf value(s) of {tensor.numel()}; the "
                                  f"checkpoint is corrupt (or diverged in training): use an earlier or re-exported one")


@dataclasses.dataclass(frozen=True, slots=True)
class LoadPlan:
    """Everything decided from config.json and tensor headers alone, before any weight is read."""

    config: PretrainedConfig
    """The critic config (critic_config applied)."""
    index: CheckpointIndex
    detection: Detection
    head: str
    """The critic class's head attribute (`score`, or `classifier` for some families)."""
    projections: set[str]
    """Vocab-sized output projections the critic leaves unused."""
    stored_head: HLGaussSupport | None
    """The head kind the checkpoint's config.json declares (None: scalar)."""

    @property
    def head_changes(self) -> bool:
        """The critic's head (config) is of another kind than the checkpoint's."""
        return support_of(self.config) != self.stored_head


def plan_load(path: str, *, config: PretrainedConfig | None = None, head_prefix: str | None = None,
              trust_remote_code: bool = False, value_head: HLGaussSupport | None | str = DECLARED_HEAD) -> LoadPlan:
    """Read config.json and the tensor headers of `path` and decide how load_critic will load it.
    `value_head`: the critic's head kind (None: scalar, an HLGaussSupport, or DECLARED_HEAD: the
    checkpoint's own)."""
    config_dict = read_config_dict(path)
    try:
        stored = None if config_dict.get(CONFIG_KEY) is None else HLGaussSupport.from_dict(
            config_dict[CONFIG_KEY], where=os.path.join(path, "config.json"))
    except ValueError as err:
        raise CriticLoadError(str(err)) from None
    hf_config = config if config is not None else load_hf_config(path, config_dict, trust_remote_code)
    critic_cfg = critic_config(hf_config, value_head=stored if value_head == DECLARED_HEAD else value_head)
    index = index_checkpoint(path)
    head = head_name(critic_cfg)
    detection = detect_format(index, config_dict, text_hidden_size(critic_cfg), head_prefix=head_prefix, head=head,
                              head_outputs=stored.num_bins if stored is not None else 1)
    projections = output_projection_keys(index, critic_cfg.get_text_config().vocab_size, detection.backbone_prefix)
    return LoadPlan(critic_cfg, index, detection, head, projections, stored)


def check_head_change(path: str, plan: LoadPlan, fresh_head: bool, init_from_scalar_head: bool) -> None:
    """Refuse a head-kind change load_critic cannot make: an HL-Gauss head is never thrown away
    silently, and init_from_scalar_head needs an HL-Gauss critic and a scalar head to start from."""
    target, stored = support_of(plan.config), plan.stored_head
    if plan.head_changes and stored is not None and not fresh_head:
        raise CriticLoadError(
            f"{path} holds {stored.describe()} (config.json {CONFIG_KEY}), but {describe(target)} was asked for: "
            f"train it with engine.loss.kind=hl_gauss and engine.loss.hl_gauss.num_bins/min_value/max_value/sigma_ratio "
            f"= {stored.num_bins}/{stored.min_value:g}/{stored.max_value:g}/{stored.sigma_ratio:g}, or start a new head "
            f"with engine.model.fresh_head=true")
    if init_from_scalar_head:
        if target is None:
            raise CriticLoadError("engine.model.init_from_scalar_head=true starts an HL-Gauss head from a scalar one: "
                                  "it needs engine.loss.kind=hl_gauss (and the support in engine.loss.hl_gauss)")
        if plan.head_changes and (fresh_head or plan.detection.head_weight is None):
            why = "engine.model.fresh_head=true ignores it" if fresh_head else \
                f"it has none ({plan.detection.format})"
            raise CriticLoadError(f"engine.model.init_from_scalar_head=true needs the scalar head of {path}, but {why}; "
                                  f"unset engine.model.init_from_scalar_head to start from a zero head")


def load_critic(
    path: str,
    *,
    torch_dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    config: PretrainedConfig | None = None,
    head_prefix: str | None = None,
    fresh_head: bool = False,
    head_init_seed: int = 0,
    adapter_path: str | None = None,
    value_head: HLGaussSupport | None | str = DECLARED_HEAD,
    init_from_scalar_head: bool = False,
):
    """Load any critic checkpoint as a per-token critic with a `score` head and no `lm_head`.

    Args:
      path: a local Hugging Face style model directory (any format in docs/ARCHITECTURE.md).
      torch_dtype: parameter dtype; values from compute_values are float32 regardless.
      attn_implementation: None picks flash_attention_2 (CUDA, bf16/fp16) > sdpa > eager (see attention.py).
      trust_remote_code: allow model code shipped with the checkpoint.
      config: use this HF config instead of path/config.json (it is passed through critic_config).
      head_prefix: the head is stored as `<prefix>.weight` (+ optional `<prefix>.bias`).
      fresh_head: ignore any head in the checkpoint and start from a fresh, seeded one.
      head_init_seed: seed of a fresh head, so that all ranks build the same one.
      adapter_path: a peft LoRA adapter directory of this critic (e.g. engine.export_adapter's):
        its LoRA weights are merged into the base weights and its head replaces the head.
      value_head: the critic's head: DECLARED_HEAD (default) the checkpoint's own (scalar, or the
        HL-Gauss head its config.json declares), None a scalar head, or an HLGaussSupport. A scalar
        checkpoint gets a zero HL-Gauss head (or, with init_from_scalar_head, one started from its
        scalar head); an HL-Gauss checkpoint asked for another head is an error unless fresh_head.
      init_from_scalar_head: see value_head (common/learning/hl_gauss.py: from_scalar_head).

    Returns (model, LoadReport). The model is in eval mode; an HL-Gauss critic's forward returns
    values ([B, T, 1] `.logits`) like a scalar one (common/learning/hl_gauss.py).
    """
    path = os.fspath(path)
    plan = plan_load(path, config=config, head_prefix=head_prefix, trust_remote_code=trust_remote_code,
                     value_head=value_head)
    critic_cfg, index, detection, head_attr = plan.config, plan.index, plan.detection, plan.head
    check_head_change(path, plan, fresh_head, init_from_scalar_head)
    scalar_source = detection if plan.head_changes and init_from_scalar_head else None
    # A head of another kind is not loaded: the checkpoint's is read aside (and used by from_scalar).
    new_head = fresh_head or plan.head_changes
    if new_head:
        detection = dataclasses.replace(detection, head_file=None)
    model_cls = critic_class(critic_cfg)
    attn = select_attn_implementation(model_cls, attn_implementation, torch_dtype)

    key_mapping = detection.key_mapping(head_attr, include_head=not new_head)
    try:
        # fork_rng: transformers initialises whatever the checkpoint lacks from the global RNG; loading
        # a critic must not change the caller's random stream (the fresh head has its own generator).
        with quiet_transformers(), torch.random.fork_rng(devices=[]):
            model, info = model_cls.from_pretrained(
                path,
                config=critic_cfg,
                dtype=torch_dtype,
                attn_implementation=per_tower(critic_cfg, attn),
                key_mapping=key_mapping or None,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
                # A head of another kind (HL-Gauss from a scalar one) has another shape; every other
                # mismatch is still refused (_check_loading_info).
                ignore_mismatched_sizes=plan.head_changes,
            )
    except RuntimeError as err:
        if "mismatched_sizes" not in str(err):
            raise
        raise CriticLoadError(_shape_mismatch_message(path, index, model_cls, critic_cfg)) from None
    install_value_head(model)
    if plan.head_changes:  # a stored head under the critic's own names does not fit: not loaded (reported)
        head_keys = {f"{head_attr}.weight", f"{head_attr}.bias"}
        info["unexpected_keys"] = sorted({*info["unexpected_keys"],
                                          *(k for k, *_ in info["mismatched_keys"] if k in head_keys)})
        info["mismatched_keys"] = [m for m in info["mismatched_keys"] if m[0] not in head_keys]
    missing, unexpected = _check_loading_info(path, info, detection, head_attr, new_head, plan.projections)
    score = critic_head(model)
    tensors, (head, bias) = head_tensors(head_attr, tuple(score.weight.shape), critic_cfg, path, index, detection,
                                         fresh_head=fresh_head, head_changes=plan.head_changes,
                                         scalar_source=scalar_source, head_init_seed=head_init_seed)
    with torch.no_grad():
        for key, tensor in tensors.items():
            getattr(score, key.rsplit(".", 1)[1]).copy_(tensor)
    if adapter_path is not None:
        from .adapter import merge_adapter

        try:
            merge_adapter(model, os.fspath(adapter_path))
        except ValueError as err:
            raise CriticLoadError(str(err)) from None
        head = "loaded"
    _check_finite(model, path)
    assert not any(name.split(".")[-1] == "lm_head" for name, _ in model.named_modules()), "critic has an lm_head"
    model.eval()

    report = LoadReport(
        path=path,
        format=detection.format,
        description=detection.description,
        storage=detection.storage,
        family=critic_cfg.model_type,
        critic_class=type(model).__name__,
        head=head,
        head_source=[] if head == "initialized" else detection.head_keys,
        bias=bias,
        attn_implementation=model.config.get_text_config()._attn_implementation,  # the language model's
        dtype=str(torch_dtype).removeprefix("torch."),
        missing_keys=missing,
        unexpected_keys=unexpected,
        value_head=describe(support_of(critic_cfg)),
        experts=describe_experts(critic_cfg),
    )
    return model, report
