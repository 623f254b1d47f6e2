"""LoRA critics: peft's LoRA layers injected into the HF critic by the model-transform stage, with
the value head trained in full (peft's `modules_to_save=["score"]`) and every base weight frozen.

  engine.lora.rank > 0 -> lora_transform(engine.lora): a ModelTransform (common/engine/transforms.py) that
  - injects peft LoRA layers (peft.inject_adapter_in_model, adapter "default") into the target
    projections, B = 0, so the critic's values are the base critic's exactly at the start;
  - keeps the head trainable and everything else frozen;
  - maps back to the plain critic at export (W + alpha/r * B @ A, on copies: a full state dict
    shares memory with the live parameters);
  - optionally starts from a peft adapter directory (lora.adapter_path).

The adapter a critic carries is written in peft's own layout (`adapter_config.json` and
`adapter_model.safetensors` with keys `base_model.model.<name>.lora_A.weight`, ...,
`base_model.model.score.weight`), so `peft.PeftModel.from_pretrained(AutoModelForTokenClassification
.from_pretrained(base), dir)` loads it with no missing or unexpected keys.
"""

from __future__ import annotations

import os
import re

import torch

from .config import LoRAConfig
from .transforms import ModelTransform
from ..valuehead.adapter import ADAPTER, ADAPTER_WEIGHTS, PEFT_PREFIX, read_adapter, read_adapter_config
from ..valuehead.config import head_name
from ..valuehead.experts import experts_of

def _is_lora_key(name: str) -> bool:
    """A LoRA weight of the injected critic (`<module>.lora_A.default.weight`, ...)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def _peft_key(name: str) -> str:
    """The key peft saves a trainable parameter of the injected critic under."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def peft_lora_config(lora: LoRAConfig, head: str | None, base_path: str | None = None):
    """peft's LoraConfig for engine.lora. `head`: the modules_to_save of a saved adapter; None when
    injecting (the critic's head stays the plain module, trained in place, not peft's wrapper copy)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), modules_to_save=[head] if head else None,
                      exclude_modules=VISION_MODULES, bias="none", base_model_name_or_path=base_path)


# A vision-language critic's vision tower (model.visual.*) is never adapted: the targets' names mean
# the language model's projections (Qwen2.5-VL's vision MLP has gate/up/down_proj too). peft matches
# a string as a regex over the whole module name.
VISION_MODULES = r"(.*\.)?visual(\..*)?"


def check_targets(model: torch.nn.Module, lora: LoRAConfig) -> None:
    """Every target module name exists in the critic as a Linear (outside a vision tower); ValueError
    naming the missing ones."""
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    in_vision = {name.rsplit(".", 1)[-1] for name in linear if re.fullmatch(VISION_MODULES, name)}
    present = {name.rsplit(".", 1)[-1] for name in linear if not re.fullmatch(VISION_MODULES, name)}
    missing = [target for target in lora.target_modules if target not in present]
    vision_only = [target for target in missing if target in in_vision]
    if vision_only:
        raise ValueError(f"engine.lora.target_modules names {vision_only}, which exist only in the vision tower "
                         f"(model.visual): LoRA adapts the language model's projections only. Train the vision "
                         f"tower in full, or freeze it (engine.transforms=[freeze_vision]), and drop {vision_only}")
    if missing:
        family = getattr(model.config, "model_type", "this model")
        why = ""
        if experts_of(model.config) is not None:
            why = (f" ({family} is a mixture of experts: transformers keeps each layer's routed experts as fused "
                   f"[experts, ...] tensors (mlp.experts.gate_up_proj, down_proj), not linear layers, and LoRA on "
                   f"them (peft's target_parameters) is not supported by the engines yet; the experts then train "
                   f"frozen)")
        raise ValueError(f"engine.lora.target_modules names {missing}, which {family} does not have as linear layers"
                         f"{why}; it has {sorted(present - {head_name(model.config)})}")


def _inject(model: torch.nn.Module, lora: LoRAConfig) -> None:
    from peft import inject_adapter_in_model

    check_targets(model, lora)
    head = head_name(model.config)
    inject_adapter_in_model(peft_lora_config(lora, None), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(_is_lora_key(name) or name.startswith(f"{head}."))
    if lora.adapter_path is not None and not _is_meta(model):
        load_adapter_into(model, lora.adapter_path)


def _is_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def lora_transform(lora: LoRAConfig) -> ModelTransform:
    """The transform engine.lora describes (rank > 0)."""
    return ModelTransform(apply=lambda model: _inject(model, lora), to_plain=lambda state: merged_state(state, lora),
                          doc=f"LoRA rank {lora.rank} on {list(lora.target_modules)}, head in full",
                          name=f"lora(rank={lora.rank}, alpha={lora.alpha:g}, targets={','.join(lora.target_modules)})")


def merged_state(state: dict[str, torch.Tensor], lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """The plain critic's state dict: each adapted projection's W + (alpha / r) * B @ A, adapters dropped."""
    scale = lora.alpha / lora.rank
    out = {}
    for key, value in state.items():
        if _is_lora_key(key):
            continue
        if ".base_layer." in key:
            module, _, leaf = key.partition(".base_layer.")
            if leaf == "weight":
                a, b = state[f"{module}.lora_A.{ADAPTER}.weight"], state[f"{module}.lora_B.{ADAPTER}.weight"]
                value = value.detach().clone() + scale * (b.float() @ a.float()).to(value.dtype)
            out[f"{module}.{leaf}"] = value
        else:
            out[key] = value
    return out


def base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain critic's state dict with the base weights only (adapters dropped, not folded in)."""
    return {key.replace(".base_layer.", "."): value for key, value in state.items() if not _is_lora_key(key)}


def injected_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (plain base keys plus LoRA keys) under the injected critic's names: each adapted
    module's own tensors as `<module>.base_layer.*` (the inverse of base_state)."""
    adapted = {key.partition(f".lora_A.{ADAPTER}.")[0] for key in state if f".lora_A.{ADAPTER}." in key}
    out = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        out[f"{module}.base_layer.{leaf}" if module in adapted and not _is_lora_key(key) else key] = value
    return out


def adapter_state(state: dict[str, torch.Tensor], head: str) -> dict[str, torch.Tensor]:
    """peft's saved keys for the LoRA weights and the head, from the transformed critic's state dict."""
    out = {}
    for key, value in state.items():
        if _is_lora_key(key) or key.startswith(f"{head}."):
            out[_peft_key(key)] = value.detach().clone().contiguous()
    return out


def write_adapter(directory: str, state: dict[str, torch.Tensor], lora: LoRAConfig, head: str,
                  base_path: str | None) -> str:
    """A peft adapter directory (atomic): adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    from ..storage.atomic_dir import atomic_directory

    with atomic_directory(directory, overwrite=True) as staging:
        peft_lora_config(lora, head, base_path).save_pretrained(staging)
        save_file(adapter_state(state, head), os.path.join(staging, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return directory


def _check_fits(model: torch.nn.Module, shapes: dict[str, tuple], path: str) -> None:
    """The adapter's tensor `shapes` (peft keys) are exactly what the injected critic `model` trains;
    ValueError naming the keys and shapes that differ (an adapter for another base model)."""
    params = dict(model.named_parameters())
    expected = {_peft_key(name): tuple(p.shape) for name, p in params.items() if p.requires_grad}
    wrong = [f"{key} {shapes[key]} (this critic: {shape})" for key, shape in expected.items()
             if key in shapes and shapes[key] != shape]
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if wrong or missing or unexpected:
        problem = "; ".join(filter(None, [
            f"shapes differ: {', '.join(wrong[:3])}" if wrong else "",
            f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else ""]))
        family = getattr(model.config, "model_type", "this critic")
        raise ValueError(f"engine.lora.adapter_path={path} does not fit {family} at engine.model.path ({problem}): "
                         f"the adapter was trained on another base model or with other target modules")


def check_adapter(path: str, lora: LoRAConfig) -> dict:
    """The adapter's config, after checking it matches engine.lora (rank, alpha, targets); before any model."""
    config = read_adapter_config(path)
    theirs = {"rank": config.get("r"), "alpha": config.get("lora_alpha"),
              "target_modules": sorted(config.get("target_modules") or [])}
    ours = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}
    differ = [f"{key}: {theirs[key]} in the adapter, {ours[key]} in engine.lora" for key in ours
              if theirs[key] != ours[key] and not (key == "alpha" and float(theirs[key] or 0) == float(ours[key]))]
    if differ:
        raise ValueError(f"engine.lora.adapter_path={path} was trained with other LoRA settings ({'; '.join(differ)}); "
                         f"set engine.lora to the adapter's")
    return config


def load_adapter_into(model: torch.nn.Module, path: str) -> None:
    """Copy a peft adapter's LoRA weights and head into a critic the LoRA transform rewrote; a key
    or shape that does not fit (an adapter for another base) is a ValueError naming it."""
    _, tensors = read_adapter(path)
    _check_fits(model, {key: tuple(t.shape) for key, t in tensors.items()}, path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(tensors[_peft_key(name)].to(param.dtype))


def check_lora(critic_config, lora: LoRAConfig) -> None:
    """What engine.lora asks of this critic, checked on a meta-device copy before anything is
    loaded or any process group exists: the target modules exist, and an adapter_path fits (its
    rank, alpha and targets are engine.lora's, its tensors have this critic's shapes)."""
    from safetensors import safe_open

    from ..valuehead.config import critic_class

    with torch.device("meta"):
        model = critic_class(critic_config)(critic_config)
    _inject(model, lora)
    if lora.adapter_path is None:
        return
    check_adapter(lora.adapter_path, lora)
    with safe_open(os.path.join(lora.adapter_path, ADAPTER_WEIGHTS), "pt") as f:  # headers only
        _check_fits(model, {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}, lora.adapter_path)
