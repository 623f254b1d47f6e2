"""The vision-language critic on VeOmni's own modeling (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): VeOmni's patched
backbone plus a head, laid out and called as transformers' generic critic (common.valuehead.config).

VeOmni 0.1.12's registry maps a VLM to its *ForConditionalGeneration (a vocab projection) or to its
*Model backbone, never to a per-token critic. So VeOmni builds the backbone (build_foundation_model: its
kernels, its init, on meta when sharded) and the head goes on it under transformers' names
(model.visual.*, model.language_model.*, score.*): loading by HF name, DCP checkpoints shared with the
fsdp backend and the HF export are unchanged.

The forward takes transformers' critic's arguments and gives VeOmni's backbone what it reads instead:
  - image_mask / video_mask (the placeholder tokens), which VeOmni's forward needs with images;
  - 2-D positions as [4, B, N] (the text row kept: it marks where packed sequences start);
  - a fourth, discarded row when B == 3 with positions: VeOmni reads a [*, 3, N] tensor as its own
    [B, 3, N] layout and transposes it, so [4, 3, N] positions fail in the first attention;
  - VeOmni's parallel state made ambient: its forward reads it, and under FSDP runs the vision tower on
    a dummy image for a modality a micro-batch lacks, so every rank all-gathers the same units in the
    same order (and outside a state VeOmni's default refuses a multi-rank world).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import TokenClassifierOutput

from ...common.valuehead.config import critic_class

# VeOmni's backbone class for each vision-language family it models (transformers' names alike).
BACKBONES = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel", "qwen3_vl": "Qwen3VLModel"}
# Attentions the vision tower runs as asked; any other (ours: causal and for text rows only, such as
# critic_packed_attention) leaves the vision tower on sdpa.
VISION_ATTENTIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


def is_vision_family(config) -> bool:
    return config.model_type in BACKBONES


def backbone_class(model_type: str) -> type:
    from veomni.models.loader import MODELING_REGISTRY

    return MODELING_REGISTRY[model_type](BACKBONES[model_type])


class VisionCritic:
    """Backbone (`model`) + `score` head; mixed into the family's VeOmni PreTrainedModel base by
    vision_critic_class (its _no_split_modules, attention support and gradient checkpointing)."""

    base_model_prefix = "model"

    def __init__(self, config, backbone: torch.nn.Module, parallel_state=None):
        super().__init__(config)
        self.model = backbone
        self.num_labels = config.num_labels
        # critic_config sets every head dropout to 0.0, so there is no dropout module.
        weight = backbone.get_input_embeddings().weight
        self.score = torch.nn.Linear(config.get_text_config().hidden_size, config.num_labels,
                                     bias=getattr(config, "token_classification_bias", True),  # transformers' key
                                     device=weight.device, dtype=weight.dtype)
        self.parallel_state = parallel_state
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool | None = False,
                **media) -> TokenClassifierOutput:
        """input_ids [B, N]; position_ids [4, B, N] (text row first), [B, N] or None; media: pixel_values,
        image_grid_thw, pixel_values_videos, video_grid_thw, second_per_grid_ts. logits [B, N, labels]."""
        rows = input_ids.shape[0]
        image_mask = input_ids == self.config.image_token_id
        video_mask = input_ids == self.config.video_token_id
        if position_ids is not None and position_ids.dim() == 2:
            position_ids = position_ids[None].expand(4, *position_ids.shape)
        if position_ids is not None and rows == 3:
            input_ids, attention_mask, position_ids, image_mask, video_mask = _with_spare_row(
                input_ids, attention_mask, position_ids, image_mask, video_mask)
        with self._ambient_parallel_state():
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False, image_mask=image_mask, video_mask=video_mask,
                                **media).last_hidden_state  # [B, N, H]
        return TokenClassifierOutput(logits=self.score(hidden[:rows]))

    def _ambient_parallel_state(self):
        if self.parallel_state is None:
            return contextlib.nullcontext()
        from veomni.distributed.parallel_state import use_parallel_state

        return use_parallel_state(self.parallel_state)


def _with_spare_row(input_ids, attention_mask, position_ids, image_mask, video_mask):
    """The batch plus a fourth row of text (token 0, no placeholders, one sequence), cut off after the
    backbone: 4 rows keep VeOmni from transposing [4, 3, N] positions."""
    length = input_ids.shape[1]
    spare = lambda t, value: torch.cat([t, torch.full_like(t[:1], value)])  # noqa: E731
    positions = torch.arange(length, device=position_ids.device, dtype=position_ids.dtype)
    position_ids = torch.cat([position_ids, positions.expand(4, 1, length)], dim=1)
    mask = None if attention_mask is None else spare(attention_mask, 1)  # all ones: no fully masked row
    return spare(input_ids, 0), mask, position_ids, spare(image_mask, False), spare(video_mask, False)


_CLASSES: dict[str, type] = {}


def vision_critic_class(config) -> type:
    """The critic class of a family (one per family): VisionCritic on the family's VeOmni
    PreTrainedModel, named as transformers' generic critic of the family
    (common.valuehead.config.critic_class), whose layout it has."""
    if config.model_type not in _CLASSES:
        backbone = backbone_class(config.model_type)
        family_base = next(base for base in backbone.__mro__[1:]
                           if issubclass(base, PreTrainedModel) and base is not PreTrainedModel)
        _CLASSES[config.model_type] = type(critic_class(config).__name__, (VisionCritic, family_base),
                                           {"__module__": __name__, "config_class": type(config)})
    return _CLASSES[config.model_type]


def build_vision_critic(critic_cfg, *, build_backbone, attn_implementation: str, parallel_state=None):
    """The critic of `critic_cfg` (a VLM critic config): `build_backbone(config)` builds VeOmni's
    backbone from a copy of it that names the backbone class (VeOmni's registry picks by
    `architectures`); the critic keeps `critic_cfg`'s architectures for its export. parallel_state:
    the VeOmni ParallelState its forwards run under (None: whatever is ambient)."""
    backbone_cfg = copy.deepcopy(critic_cfg)
    backbone_cfg.architectures = [BACKBONES[critic_cfg.model_type]]
    backbone = build_backbone(backbone_cfg)
    if attn_implementation not in VISION_ATTENTIONS:
        backbone.set_attn_implementation({"vision_config": "sdpa"})
    _add_transformers_buffers(backbone)
    config = backbone.config  # the backbone's (VeOmni set its attention on it), with the critic's name
    config.architectures = list(critic_cfg.architectures)
    return vision_critic_class(critic_cfg)(config, backbone, parallel_state)


def _add_transformers_buffers(backbone: torch.nn.Module) -> None:
    """transformers' vision rotary keeps a copy of its frequencies (original_inv_freq, for dynamic
    rope; unused here) that VeOmni's lacks: added, so both critics have the same tensors by name
    (the engine fills every one from the loaded critic and refuses names either side lacks)."""
    rotary = backbone.visual.rotary_pos_emb
    if "original_inv_freq" not in dict(rotary.named_buffers(recurse=False)):
        rotary.register_buffer("original_inv_freq", rotary.inv_freq.clone(), persistent=False)
