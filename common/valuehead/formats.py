"""Detect which critic checkpoint format a directory holds and where its value head lives.

Every format in the wild stores the same thing — a backbone and a [1, H] linear head, read at each
token — under different names (see docs/ARCHITECTURE.md, "The critic": formats read). Detection only
needs tensor names and shapes, so it is explicit and cheap, and the result says exactly how to
rename the head to our `score.*` layout.
"""

from __future__ import annotations

import dataclasses
import re

from .checkpoint_files import CheckpointIndex
from .config import GENERIC_ARCHITECTURE
from .errors import CriticLoadError

# verl's patched trl wrapper saves nn.Module.state_dict(): the backbone under this prefix.
TRL_WRAPPER_PREFIX = "pretrained_model."


@dataclasses.dataclass(frozen=True, slots=True)
class HeadLayout:
    """One known way of storing a value head: its tensor names in a checkpoint."""

    format: str
    weight: str
    bias: str | None
    description: str


# Checked in order; the first layout whose weight tensor is present (with a [1, H] shape) wins.
# `bias=None`: the format never has a bias, so ours is set to zero (the values are unchanged).
KNOWN_HEADS: tuple[HeadLayout, ...] = (
    HeadLayout("trl-value-head", "v_head.summary.weight", "v_head.summary.bias",
               "trl AutoModelForCausalLMWithValueHead (save_pretrained, or verl's patched state_dict)"),
    HeadLayout("hf-token-classification", "score.weight", "score.bias",
               "Hugging Face *ForTokenClassification(num_labels=1) (verl FSDP/VeOmni, NeMo-RL, ROLL, ours)"),
    HeadLayout("hf-sequence-classification", "score.weight", None,
               "Hugging Face *ForSequenceClassification reward model (trl PPOTrainer value/reward model)"),
    HeadLayout("verl-legacy-critic", "lm_head.0.weight", "lm_head.0.bias",
               "verl's old create_huggingface_critic (lm_head replaced by Linear(H, 1))"),
    HeadLayout("megatron-export", "lm_head.weight", "lm_head.bias",
               "Megatron critic exported to HF (verl merger, mbridge, Megatron-Bridge; slime adds a bias)"),
)
LAYOUTS_BY_FORMAT = {layout.format: layout for layout in KNOWN_HEADS}


@dataclasses.dataclass(frozen=True, slots=True)
class Detection:
    """What `load_critic` will do with a checkpoint: its format and where the head comes from."""

    format: str
    description: str
    head_weight: str | None
    """Checkpoint key of the head weight (None: the checkpoint has no head; a fresh one is made)."""
    head_bias: str | None
    """Checkpoint key of the head bias (None: zero bias)."""
    head_file: str | None
    """A sidecar file holding the head, when it is not in the main weight files."""
    backbone_prefix: str
    """Prefix to strip from every backbone key ('' for all formats but verl's patched trl)."""
    storage: str
    """'single-file', 'sharded' or 'sidecar'."""

    def key_mapping(self, head: str, *, include_head: bool = True) -> dict[str, str]:
        """Regex renames for transformers' from_pretrained(key_mapping=...): the detected head to
        the critic's `<head>.weight/.bias`, and the backbone prefix away."""
        mapping: dict[str, str] = {}
        if self.backbone_prefix:
            mapping[f"^{re.escape(self.backbone_prefix)}"] = ""
        if include_head and self.head_file is None and self.head_weight is not None:
            if self.head_weight != f"{head}.weight":
                mapping[f"^{re.escape(self.head_weight)}$"] = f"{head}.weight"
            if self.head_bias is not None and self.head_bias != f"{head}.bias":
                mapping[f"^{re.escape(self.head_bias)}$"] = f"{head}.bias"
        return mapping

    @property
    def head_keys(self) -> list[str]:
        return [key for key in (self.head_weight, self.head_bias) if key is not None]


def _check_head_shape(key: str, shape: tuple[int, ...], want: tuple[int, ...], where: str) -> None:
    if tuple(shape) != want:
        hint = ""
        if len(want) == 2 and len(shape) == 2 and shape[0] * shape[1] == want[1] and shape[0] != 1:
            hint = (f" It holds exactly {want[1]} numbers, like a [1, H] head stored reshaped (ORZ's "
                    f"released critics use [8, H/8]); reshape it to {list(want)} and save it again.")
        raise CriticLoadError(
            f"value head tensor {key!r} in {where} has shape {list(shape)}, but a value head for this "
            f"model must be {list(want)} (hidden size {want[-1] if len(want) == 2 else '?'}).{hint}"
        )


def detect_format(
    index: CheckpointIndex,
    config_dict: dict,
    hidden_size: int,
    *,
    head_prefix: str | None = None,
    head: str = "score",
    head_outputs: int = 1,
) -> Detection:
    """Decide the checkpoint's format from its tensor names/shapes and config.json.

    `head_prefix` names the head explicitly (`<prefix>.weight`, optional `<prefix>.bias`), for
    checkpoints whose head has a name no format here uses (OpenRLHF's --value_head_prefix).
    `head` is the critic class's own head name (`classifier` for gpt_neox/gpt2/bloom TokenCls).
    `head_outputs`: the head's rows, 1 for a scalar critic, num_bins for an HL-Gauss one (its
    config.json says which).
    """
    names = index.tensors
    prefix = TRL_WRAPPER_PREFIX if any(k.startswith(TRL_WRAPPER_PREFIX) for k in names) else ""
    storage = "sharded" if index.sharded else "single-file"
    weight_shape, bias_shape = (head_outputs, hidden_size), (head_outputs,)

    def found(fmt: str, description: str, weight: str, bias: str | None, head_file: str | None = None,
              tensors: dict | None = None, where: str = "the checkpoint") -> Detection:
        tensors = names if tensors is None else tensors
        _check_head_shape(weight, tensors[weight].shape, weight_shape, where)
        if bias is not None and bias not in tensors:
            bias = None
        if bias is not None:
            _check_head_shape(bias, tensors[bias].shape, bias_shape, where)
        return Detection(fmt, description, weight, bias, head_file, prefix,
                         "sidecar" if head_file else storage)

    explicit = head_prefix or config_dict.get("value_head_prefix")
    if explicit:
        weight = f"{explicit}.weight"
        if weight not in names:
            source = "head_prefix" if head_prefix else "config.json value_head_prefix"
            raise CriticLoadError(
                f"{source} is {explicit!r} but the checkpoint has no tensor {weight!r}; head-like "
                f"tensors present: {_head_like(names) or 'none'}"
            )
        fmt = "custom-head-prefix" if head_prefix else "openrlhf"
        return found(fmt, f"value head stored as {explicit}.weight"
                     + (" (OpenRLHF config.value_head_prefix)" if not head_prefix else ""),
                     weight, f"{explicit}.bias")

    trl = LAYOUTS_BY_FORMAT["trl-value-head"]
    if trl.weight in names:
        return found(trl.format, trl.description, trl.weight, trl.bias)
    if trl.weight in index.sidecar_tensors:
        return found(trl.format, f"{trl.description}, head in sidecar {index.sidecar}",
                     trl.weight, trl.bias, head_file=index.sidecar, tensors=index.sidecar_tensors,
                     where=index.sidecar)
    if index.sidecar is not None:
        raise CriticLoadError(
            f"sidecar {index.sidecar} has no {trl.weight!r}; its tensors: {sorted(index.sidecar_tensors)}"
        )

    native = LAYOUTS_BY_FORMAT["hf-token-classification"]
    if head != "score" and prefix + f"{head}.weight" in names:
        return found(native.format, native.description, prefix + f"{head}.weight", prefix + f"{head}.bias")
    for layout in KNOWN_HEADS[1:]:
        key = prefix + layout.weight
        if key not in names:
            continue
        if layout.format == "megatron-export" and names[key].shape[0] != head_outputs:
            continue  # a vocab-sized lm_head: an ordinary causal LM
        bias = prefix + layout.bias if layout.bias else None
        has_bias = bias is not None and bias in names
        if layout.format == "hf-token-classification" and not has_bias:
            continue  # no bias: the sequence-classification layout below
        if layout.format == "hf-token-classification" and config_dict.get("architectures") == [GENERIC_ARCHITECTURE]:
            return found("generic-token-classification",
                         "critic-adapters generic layout (family backbone + score head)", key, bias)
        return found(layout.format, layout.description, key, bias)

    has_lm_head = any(k.startswith(prefix + "lm_head.") for k in names)
    if has_lm_head:
        return Detection("causal-lm", "causal LM without a value head (fresh head)", None, None,
                         None, prefix, storage)
    return Detection("base-model", "backbone without any head (fresh head)", None, None, None,
                     prefix, storage)


def _head_like(names) -> list[str]:
    """Top-level tensors (`<module>.<param>`): where heads live, as opposed to backbone internals."""
    return sorted(k for k in names if k.count(".") == 1)
