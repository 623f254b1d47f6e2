"""The critic built by VeOmni: config from the shared hook, weights filled by the engine from the
loaded critic (by HF parameter name), and a guarded dispatch that cannot silently yield a causal LM.

  common.valuehead.critic_config --> build_foundation_model (VeOmni's registry picks the class;
  a vision-language critic is VeOmni's backbone with our head: vision_critic.py)
  --> check_class: the class, no lm_head, a [1, H] head; after the weights are in: nothing on
  meta, and [B, T, 1] on a probe of the critic's one-layer twin (probe_config)

VeOmni builds a model from `config.architectures` through a per-family registry function. Its
fallback for an architecture it does not recognise is the family's *ForCausalLM (0.1.12's
per-family registration), and 0.1.10 / 0.1.11 do not recognise *ForTokenClassification at all: a critic
asked for the naive way comes out as a [B, T, vocab] causal LM. The check after the build turns
any such build into an error naming the VeOmni version and the fix.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch

from ...common.engine.registry import backends_for_family
from ...common.parallel import ulysses
from ...common.parallel.batching import pack
from ...common.parallel.packed_attention import sequence_bounds
from ...common.valuehead.config import architecture_name, config_in_dtype, critic_class, head_name
from ...common.valuehead.multimodal import is_vision_critic
from .vision_critic import BACKBONES, build_vision_critic, is_vision_family

VEOMNI_REQUIREMENT = "veomni==0.1.12"


def veomni_version() -> str:
    from veomni import __version__

    return __version__


# The model_types VeOmni 0.1.12 has its own modeling for (veomni.models.loader.MODELING_REGISTRY; a
# test checks this list against the installed VeOmni). Kept here so that the launcher's check does
# not import VeOmni (seconds, and a banner) before any process starts.
VEOMNI_FAMILIES = ("deepseek_v3", "deepseek_v4", "flux", "gemma3_text", "glm_moe_dsa", "gpt_oss", "llama", "movqgan",
                   "qwen2", "qwen2_5_omni", "qwen2_5_vl", "qwen2_vl", "qwen3", "qwen3_5", "qwen3_5_moe",
                   "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_omni_moe", "qwen3_vl", "qwen3_vl_moe",
                   "seed_oss")


def modeling_backend() -> str:
    """'veomni' (its patched modeling classes, from its registry) or 'hf' (transformers' classes),
    as VeOmni reads it from the MODELING_BACKEND environment variable (veomni.utils.env: default veomni)."""
    return os.environ.get("MODELING_BACKEND", "veomni")


def check_family_registered(config) -> None:
    """ValueError for a model type VeOmni has no modeling for, before anything is built."""
    if is_vision_critic(config):
        check_vision_family(config)
        return
    if modeling_backend() == "hf" or config.model_type in VEOMNI_FAMILIES:
        return
    raise ValueError(
        f"VeOmni {VEOMNI_REQUIREMENT.split('==')[1]} has no modeling for model_type {config.model_type!r} (it has: "
        f"{', '.join(VEOMNI_FAMILIES)}). Run with the environment variable "
        f"MODELING_BACKEND=hf to build it from transformers' classes through VeOmni (set it yourself: VeOmni "
        f"reads it process-wide, so the engine does not), or use "
        f"{' or '.join(f'backend={name}' for name in backends_for_family(config.model_type, besides='veomni'))} "
        f"for this family")


def check_vision_family(config) -> None:
    """ValueError for a vision-language critic this backend does not build (vision_critic.py)."""
    others = " or ".join(f"backend={name}" for name in backends_for_family(config.model_type, besides="veomni"))
    if not is_vision_family(config):
        raise ValueError(f"the VeOmni backend builds vision-language critics for {', '.join(BACKBONES)}, not "
                         f"{config.model_type!r}; use {others or 'another backend'} for this family")
    if modeling_backend() == "hf":
        raise ValueError(f"a {config.model_type} critic is built on VeOmni's own modeling, and MODELING_BACKEND=hf "
                         f"makes VeOmni build transformers' *ForConditionalGeneration instead: unset MODELING_BACKEND, "
                         f"or use {others or 'another backend'}")


def check_layout(model_config, engine_config, world_size: int) -> None:
    """The BackendSpec hook (common/engine/registry.py): what the VeOmni backend refuses for this model
    and layout, from the config alone; the launcher, the dry run and the trainer call it before any
    process starts, and the engine calls it when it is built."""
    check_family_registered(model_config)
    ulysses.check_layout(model_config, engine_config, world_size)
    if engine_config.cpu_offload and world_size is not None and world_size // engine_config.parallel.ulysses == 1:
        from .parallelize import ONE_RANK_OFFLOAD

        raise ValueError(ONE_RANK_OFFLOAD)
    if engine_config.parallel.ulysses > 1 and is_vision_critic(model_config):
        # VeOmni's Qwen-VL runs its vision tower on a dummy image in every forward, text rows too, and
        # that forward fails on the sequence-split inputs (split sizes of the whole row).
        raise ValueError(f"engine.parallel.ulysses={engine_config.parallel.ulysses} with a vision-language critic "
                         f"({model_config.model_type}) on veomni: VeOmni's model runs its vision tower in every "
                         f"forward, which fails on split rows; use backend=fsdp (its text rows run under Ulysses) "
                         f"or engine.parallel.ulysses=1")


def build_critic(critic_cfg, *, weights_path: str | None, dtype: str, attn_implementation: str,
                 init_device: str, fused_ops: str = "eager", parallel_state=None) -> torch.nn.Module:
    """VeOmni's build_foundation_model on the critic config (a copy: VeOmni writes into it); for a
    vision-language critic, on its backbone's (vision_critic.py; weights_path must be None: the
    engine fills it by HF name), whose forwards then run under `parallel_state`.

    VeOmni installs its loss wrappers into transformers' LOSS_MAPPING (cross_entropy/__init__.py:
    install_loss_mapping; they return a 3-tuple where transformers' return a tensor), which would change
    every causal LM's loss in this process. The critic computes no transformers loss (no labels
    are ever passed), so the mapping is put back as it was after the build.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.models.auto import build_foundation_model

    from . import compat

    def build(config):
        return build_foundation_model(config_path=config, weights_path=weights_path, torch_dtype=dtype,
                                      init_device=init_device,
                                      ops_implementation=compat.ops_implementation(attn_implementation, fused_ops))

    # A copy in the dtype asked for: VeOmni writes into it, and a nested backbone build takes config.dtype.
    critic_cfg = config_in_dtype(critic_cfg, getattr(torch, dtype))
    saved_losses = dict(LOSS_MAPPING)
    try:
        if is_vision_critic(critic_cfg):
            assert weights_path is None, "a vision critic's weights are filled by HF name, not by VeOmni's loader"
            return build_vision_critic(critic_cfg, build_backbone=build, attn_implementation=attn_implementation,
                                       parallel_state=parallel_state)
        return build(critic_cfg)
    finally:
        LOSS_MAPPING.clear()
        LOSS_MAPPING.update(saved_losses)


def _dispatch_error(what: str, model: torch.nn.Module, expected: str) -> ValueError:
    return ValueError(
        f"VeOmni {veomni_version()} built {type(model).__module__}.{type(model).__name__} for a critic "
        f"({expected} was asked for through config.architectures): {what}. VeOmni falls back to the family's "
        f"*ForCausalLM when its registry does not map *ForTokenClassification (veomni 0.1.10 and 0.1.11 never do); "
        f"install {VEOMNI_REQUIREMENT} (tools/setup.sh), or use backend=fsdp for this family")


def expected_class_name(critic_cfg) -> str:
    """The class name the built critic must have: the `architectures` entry, or for a vision critic
    transformers' generic critic class of the family, whose layout vision_critic.py builds."""
    return critic_class(critic_cfg).__name__ if is_vision_critic(critic_cfg) else architecture_name(critic_cfg)


def check_class(model: torch.nn.Module, critic_cfg) -> None:
    """The critic class, no vocab projection, a [1, H] head ([num_bins, H] for HL-Gauss). Local: no collective."""
    expected = expected_class_name(critic_cfg)
    if type(model).__name__ != expected:
        raise _dispatch_error(f"its class is {type(model).__name__}, not {expected}", model, expected)
    projections = [name for name, _ in model.named_modules() if name.split(".")[-1] == "lm_head"]
    if projections:
        raise _dispatch_error(f"it has a vocab projection {projections}", model, expected)
    head = getattr(model, head_name(critic_cfg), None)
    outputs = critic_cfg.num_labels
    if not isinstance(head, torch.nn.Linear) or head.out_features != outputs:
        raise _dispatch_error(f"its head {head_name(critic_cfg)!r} is {head!r}, not Linear(H, {outputs})", model, expected)


def check_materialized(model: torch.nn.Module) -> None:
    """No parameter or buffer left on the meta device (VeOmni's cpu init on a rank VeOmni thinks is not
    rank 0 builds an all-meta model without an error: build_foundation_model)."""
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ValueError(
            f"VeOmni {veomni_version()} left {len(on_meta)} tensors of the critic on the meta device "
            f"(e.g. {on_meta[:3]}): its weights were never loaded. VeOmni skips loading when it does not see this "
            f"process as rank 0 (no process group, or init_device=cpu on another rank); build the engine "
            f"through common.engine.build_engine after common.parallel.distributed.init_distributed")


# The probe's twin (probe_config): one layer, a 32-token vocabulary and MLPs 32 wide.
PROBE_WIDTH = 32
_MLP_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
# Vision-tower block indices with a role (Qwen2.5-VL's full-attention blocks, Qwen3-VL's deepstack outputs).
_VISION_BLOCK_LISTS = ("fullatt_block_indexes", "deepstack_visual_indexes")


def probe_config(critic_cfg):
    """The config of the critic's twin that check_probe_output runs on: a copy of `critic_cfg` with
    one layer, a vocabulary of at most PROBE_WIDTH tokens and MLPs at most PROBE_WIDTH wide. VeOmni
    builds it as the same class with the same head, attention shapes (head counts, head_dim, hidden
    size: a Ulysses split and rotary sections stay valid) and kernels, so the probe's outcome is the
    critic's, for a few MiB at any model size; a forward of the sharded critic itself gathers whole
    layers (0.72x of a 4-layer critic per rank). The probe's token ids (0-3) are the same in both."""
    config = copy.deepcopy(critic_cfg)
    text = config.get_text_config()
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None) is not None:  # transformers' per-layer list (sliding / full, linear)
        text.layer_types = text.layer_types[:1]
    text.vocab_size = min(text.vocab_size, PROBE_WIDTH)
    if getattr(text, "pad_token_id", None) is not None and text.pad_token_id >= text.vocab_size:
        text.pad_token_id = None  # the embedding's padding row: outside the small vocabulary
    for name in _MLP_WIDTHS:
        if getattr(text, name, None):
            setattr(text, name, min(getattr(text, name), PROBE_WIDTH))
    if is_vision_critic(config):
        _shrink_vision(config.vision_config)
    return config


def _shrink_vision(vision) -> None:
    """A vision tower of one block (MLP at most PROBE_WIDTH wide), its widths, heads and patching
    kept (the merger's output is the text hidden size); a block-role list that is not empty keeps
    one role, on block 0. The probe's rows hold no image; under FSDP VeOmni's forward runs the tower
    on a dummy image, which this tower takes as the critic's would."""
    vision.depth = 1
    if getattr(vision, "intermediate_size", None):
        vision.intermediate_size = min(vision.intermediate_size, PROBE_WIDTH)
    for name in _VISION_BLOCK_LISTS:
        if getattr(vision, name, None):
            setattr(vision, name, [0])


@torch.no_grad()
def probe_output(model: torch.nn.Module, critic_cfg, device: torch.device, sp_group=None) -> torch.Tensor:
    """`model`'s output on a [1, 4] probe (token ids 0-3; with a Ulysses group, each rank runs its share
    of the columns and gets the whole row back). Every rank runs it (collectives when `model` is sharded)."""
    ids = torch.arange(4)[None] % critic_cfg.get_text_config().vocab_size
    positions = torch.arange(4)[None]
    was_training = model.training
    model.eval()
    if sp_group is None:
        with sequence_bounds(positions):
            logits = model(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False).logits
    else:
        split = ulysses.split_micro_batch(pack(ids, torch.ones_like(ids), [0]), sp_group)
        with ulysses.active(split):
            logits = model(input_ids=split.input_ids.to(device), position_ids=split.position_ids.to(device),
                           use_cache=False).logits
            logits = logits if logits.is_meta else split.gather(logits)
    model.train(was_training)
    return logits


def check_probe_output(model: torch.nn.Module, critic_cfg, device: torch.device, sp_group=None) -> None:
    """A [1, 4] probe (probe_output) gives [1, 4, 1] real (not meta) outputs. The engine runs it on the
    critic's twin (probe_config), `critic_cfg` the twin's config."""
    expected = architecture_name(critic_cfg)
    logits = probe_output(model, critic_cfg, device, sp_group=sp_group)
    if logits.is_meta:
        raise _dispatch_error("its output on a probe is on the meta device (weights never loaded)", model, expected)
    if tuple(logits.shape) != (1, 4, 1):
        raise _dispatch_error(f"on a [1, 4] probe it returns {list(logits.shape)}, not [1, 4, 1]", model, expected)


# Attributes build_foundation_model writes into the model's config (build_foundation_model): VeOmni's own
# switches, not part of the model, so an exported config.json must not carry them.
VEOMNI_CONFIG_FIELDS = ("encoder_data_balance", "encoder_data_balance_sorting_algo")


@contextlib.contextmanager
def without_veomni_fields(config):
    """`config` without VeOmni's switches inside the block (for save_critic); restored after."""
    saved = {name: getattr(config, name) for name in VEOMNI_CONFIG_FIELDS if hasattr(config, name)}
    for name in saved:
        delattr(config, name)
    try:
        yield config
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
