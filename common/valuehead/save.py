"""save_critic: write a critic as a plain Hugging Face `*ForTokenClassification` checkpoint.

`AutoModelForTokenClassification.from_pretrained(out_dir)` loads the result with no missing or
unexpected keys. The tensors are written one at a time (write_critic: an engine streams them as it
gathers them), under the model's own key names: transformers' save_pretrained would by default
reverse the renames used at load time and write our head back under its source name (e.g.
v_head.summary.*), the exact mislabelling this project exists to prevent. An HL-Gauss critic is written with num_labels = num_bins and its support in
config.json (`critic_value_head`); plain transformers then returns its bin logits, load_critic its values. Families transformers has no TokenClassification class for get the same tensors
(`model.*` + `score.*`) with `architectures=["GenericForTokenClassification"]`, which load_critic
reads back (docs/ARCHITECTURE.md, "Generic layout").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch

from ..storage.atomic_dir import atomic_directory
from ._quiet import quiet_transformers
from ..learning.hl_gauss import describe, support_of
from .config import architecture_name, critic_config, head_name
from .safetensors_stream import DEFAULT_MAX_SHARD_SIZE, TensorSpec, write_streaming


def save_critic(
    model: torch.nn.Module,
    out_dir: str,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> str:
    """Write `model` (a critic from load_critic, possibly FSDP-wrapped) to `out_dir` as safetensors.

    `state_dict`: the full state dict to write instead of model.state_dict() (e.g. gathered from
    FSDP shards on rank 0). The directory appears complete or not at all; an existing non-empty
    `out_dir` is an error unless `overwrite=True`. Files are cut at `max_shard_size` bytes
    (common/valuehead/safetensors_stream.py).
    """
    state = model.state_dict() if state_dict is None else state_dict
    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    return write_critic(model.config, out_dir, specs, iter(state.items()), overwrite=overwrite,
                        max_shard_size=max_shard_size)


def check_head_outputs(config, specs: list[TensorSpec]) -> None:
    """The head's output count is the one the config declares (1, or an HL-Gauss head's bins)."""
    support = support_of(config)
    expected = 1 if support is None else support.num_bins
    weight = next((s for s in specs if s.name == f"{head_name(config)}.weight"), None)
    if weight is None:
        raise ValueError(f"save_critic: the state has no {head_name(config)}.weight (the value head)")
    if weight.shape[0] != expected:
        raise ValueError(f"save_critic: the head has {weight.shape[0]} outputs, but the config declares "
                         f"{describe(support)} ({expected})")


def write_critic(config, out_dir: str, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]], *,
                 overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> str:
    """save_critic for a state that arrives one tensor at a time: `specs` names every tensor's
    shape and dtype up front, `tensors` yields (name, tensor) pairs in any order, each dropped once
    written (common/valuehead/safetensors_stream.py). `tensors` is run to its end even when the
    write fails, so ranks that gather it together finish together; the error is raised after."""
    tensors = iter(tensors)
    try:
        check_head_outputs(config, specs)
        config = critic_config(config)
        floating = [s.dtype for s in specs if s.dtype.is_floating_point]
        if floating:
            config.dtype = floating[0]
        with atomic_directory(os.fspath(out_dir), overwrite=overwrite) as staging:
            write_streaming(staging, specs, tensors, max_shard_size=max_shard_size)
            with quiet_transformers():
                config.save_pretrained(staging)
            config_file = os.path.join(staging, "config.json")
            with open(config_file) as f:
                written = json.load(f)
            written["architectures"] = [architecture_name(config)]
            if "value_head_prefix" in written:
                # OpenRLHF's config names where its head lives; the head is now written as <head>.*, so
                # say so (OpenRLHF then still loads it, and so do inspect and load_critic).
                written["value_head_prefix"] = head_name(config)
            with open(config_file, "w") as f:
                json.dump(written, f, indent=2, sort_keys=True)
                f.write("\n")
    except BaseException:
        for _ in tensors:  # the rest of the gathers, with the other ranks
            pass
        raise
    return os.path.abspath(out_dir)
