"""save_critic: write a critic as a plain Hugging Face `*ForTokenClassification` checkpoint.

`AutoModelForTokenClassification.from_pretrained(out_dir)` loads the result with no missing or
unexpected keys. An HL-Gauss critic is written with num_labels = num_bins and its support in
config.json (`critic_value_head`); plain transformers then returns its bin logits, load_critic its values. Families transformers has no TokenClassification class for get the same tensors
(`model.*` + `score.*`) with `architectures=["GenericForTokenClassification"]`, which load_critic
reads back (docs/ARCHITECTURE.md, "Generic layout").
"""

from __future__ import annotations

import json
import os

import torch

from ..storage.atomic_dir import atomic_directory
from ._quiet import quiet_transformers
from ..learning.hl_gauss import describe, support_of
from .config import architecture_name, critic_config, critic_head, head_name


def save_critic(
    model: torch.nn.Module,
    out_dir: str,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> str:
    """Write `model` (a critic from load_critic, possibly FSDP-wrapped) to `out_dir` as safetensors.

    `state_dict`: the full state dict to write instead of model.state_dict() (e.g. gathered from
    FSDP shards on rank 0). The directory appears complete or not at all; an existing non-empty
    `out_dir` is an error unless `overwrite=True`.
    """
    head = critic_head(model)
    support = support_of(model.config)
    expected = 1 if support is None else support.num_bins
    if head.out_features != expected:
        raise ValueError(f"save_critic: the head has {head.out_features} outputs, but the config declares "
                         f"{describe(support)} ({expected})")
    config = critic_config(model.config)
    with atomic_directory(os.fspath(out_dir), overwrite=overwrite) as staging:
        original_config = model.config
        model.config = config
        # transformers writes only on global rank 0 of an initialised process group; the caller is
        # the rank that writes (an engine on a sub-world of the host's ranks has no rank 0 in it).
        model.should_save_on_this_rank = lambda is_main_process: True
        try:
            with quiet_transformers():
                # save_original_format=False: write the model's own key names. By default transformers
                # would reverse the renames used at load time, writing our head back under its source
                # name (e.g. v_head.summary.*) — the exact mislabelling this project exists to prevent.
                model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True,
                                      save_original_format=False)
        finally:
            model.config = original_config
            del model.should_save_on_this_rank
        # save_pretrained writes the Python class name; the generic critic's is our own dynamic class.
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
    return os.path.abspath(out_dir)
