"""A peft LoRA adapter directory of a critic (adapter_config.json + adapter_model.safetensors): how
it is named on disk, read, and folded into a plain critic. One of the critic formats the loader
reads (`load_critic(..., adapter_path=)`, `convert SRC DST --adapter`); training LoRA critics is
common/engine/lora.py's, which writes and loads these directories through the names here.
"""

from __future__ import annotations

import json
import os

import torch

from .config import head_name

ADAPTER = "default"  # peft's adapter name inside the module tree (not in the saved keys)
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def read_adapter_config(path: str) -> dict:
    """adapter_config.json of a peft LoRA adapter directory (which must hold its weights too);
    ValueError for anything else."""
    config_file, weights = os.path.join(path, ADAPTER_CONFIG), os.path.join(path, ADAPTER_WEIGHTS)
    if not (os.path.isfile(config_file) and os.path.isfile(weights)):
        raise ValueError(f"engine.lora.adapter_path={path} is not a peft adapter directory (it needs {ADAPTER_CONFIG} "
                         f"and {ADAPTER_WEIGHTS})")
    with open(config_file) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type={config.get('peft_type')!r}; only LoRA adapters load here")
    return config


def read_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, its tensors) of a peft LoRA adapter directory."""
    from safetensors.torch import load_file

    config = read_adapter_config(path)
    return config, load_file(os.path.join(path, ADAPTER_WEIGHTS))


def merge_adapter(critic: torch.nn.Module, path: str) -> torch.nn.Module:
    """Fold a peft LoRA adapter (and the head it carries) into a plain critic in place: what
    `load_critic(..., adapter_path=)` and `convert SRC DST --adapter` do. ValueError when the
    adapter does not fit the critic (another base model, other modules)."""
    config, tensors = read_adapter(path)
    scale = float(config["lora_alpha"]) / float(config["r"])
    params = dict(critic.named_parameters())
    head = head_name(critic.config)
    used = set()
    with torch.no_grad():
        for key, tensor in tensors.items():
            name = key.removeprefix(PEFT_PREFIX)
            if name.endswith(".lora_A.weight"):
                module = name.removesuffix(".lora_A.weight")
                b_key = f"{PEFT_PREFIX}{module}.lora_B.weight"
                target = params.get(f"{module}.weight")
                if target is None or b_key not in tensors:
                    raise ValueError(f"adapter {path}: {key} names a module this critic does not have (or has no "
                                     f"lora_B); the adapter is for another base model")
                delta = scale * (tensors[b_key].float() @ tensor.float())
                if tuple(delta.shape) != tuple(target.shape):
                    raise ValueError(f"adapter {path}: {module} would change a {tuple(target.shape)} weight by "
                                     f"{tuple(delta.shape)}; the adapter is for another base model")
                target.add_(delta.to(target.dtype))
                used |= {key, b_key}
            elif name.startswith(f"{head}."):
                target = params.get(name)
                if target is None or tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"adapter {path}: its head {name} {tuple(tensor.shape)} does not fit this critic's "
                                     f"{None if target is None else tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))
                used.add(key)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"adapter {path}: tensors {unused[:4]} are neither LoRA weights nor the head {head!r}; only "
                         f"LoRA adapters of a critic merge")
    return critic
