"""Tiny model configs kept in the repo, and builders for random checkpoints made from them.

Tests and the default job never download a model: they build a tiny random model from one of
these configs. Files are found through Bazel runfiles when running under Bazel, else beside
this module (plain pytest, vendored copies). Beside common.valuehead in the layers: it may import
common.valuehead and the layers below it.
"""

from __future__ import annotations

import json
import os

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

_WORKSPACE = "critic_adapters"
_HERE = os.path.dirname(os.path.abspath(__file__))

# Families with a tiny config in configs/; the VLM_FAMILIES below are the vision-language ones.
FAMILIES = ("deepseek_v3", "gemma2", "gemma3_text", "gpt_neox", "llama", "mistral", "mixtral", "phi3", "qwen2",
            "qwen2_5_vl", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_moe", "qwen3_vl")
# The mixture-of-experts families (4 experts, top-2; qwen2_moe with its shared expert).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def data_path(relative: str) -> str:
    """Absolute path of a file under common/testdata, via runfiles when Bazel provides them."""
    if os.environ.get("RUNFILES_DIR") or os.environ.get("RUNFILES_MANIFEST_FILE"):
        try:
            from runfiles import runfiles
        except ImportError:
            # A stack's own Bazel run sets RUNFILES_DIR without the bazel-runfiles pip package:
            # the file beside this module is the same file.
            runfiles = None
        if runfiles is not None:
            located = runfiles.Create().Rlocation(f"{_WORKSPACE}/common/testdata/{relative}")
            if located and os.path.exists(located):
                return located
    return os.path.join(_HERE, relative)


def tiny_config(family: str) -> PretrainedConfig:
    if family not in FAMILIES:
        raise ValueError(f"no tiny config for {family!r}; available: {', '.join(FAMILIES)}")
    with open(data_path(f"configs/{family}.json")) as f:
        fields = json.load(f)
    return CONFIG_MAPPING[fields.pop("model_type")](**fields)


def tiny_causal_lm(family: str, seed: int = 0, vocab_size: int | None = None) -> torch.nn.Module:
    """A random causal LM (a VLM for VLM families), deterministic for a given seed; `vocab_size` (at
    least the tiny config's own, whose special and image token ids sit below it) gives it a real
    tokenizer's vocabulary."""
    config = tiny_config(family)
    if vocab_size is not None:
        text = config.get_text_config()
        if vocab_size < text.vocab_size:
            raise ValueError(f"vocab_size={vocab_size}: the tiny {family} model needs at least {text.vocab_size} ids "
                             f"(its special and image token ids sit below that); give your tokenizer's vocabulary size")
        text.vocab_size = vocab_size
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family in VLM_FAMILIES else AutoModelForCausalLM
    return auto.from_config(config).eval()


def save_tiny_causal_lm(family: str, out_dir: str, seed: int = 0, vocab_size: int | None = None) -> str:
    from ..valuehead._quiet import quiet_transformers

    with quiet_transformers():
        tiny_causal_lm(family, seed, vocab_size).save_pretrained(out_dir)
    return out_dir
