"""compute_values: per-token scalar values from a critic, never touching a vocab projection (and
compute_bin_logits: an HL-Gauss critic's bin logits, for training)."""

from __future__ import annotations

import torch

from ..learning.hl_gauss import bin_logits, support_of
from ..parallel.packed_attention import sequence_bounds
from . import multimodal


def is_packed(position_ids: torch.Tensor) -> bool:
    """True when position ids restart at 0 inside a row: several sequences packed into one row."""
    return bool((position_ids[..., 1:] == 0).any())


def uses_multimodal_rope(config) -> bool:
    """Families with mrope (qwen2_vl, qwen2_5_vl, qwen3_vl, glm4v, ...) take 3-D positions."""
    text_config = config.get_text_config()
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(text_config, name, None)
        if isinstance(rope, dict) and "mrope_section" in rope:
            return True
    return False


def model_position_ids(config, position_ids: torch.Tensor) -> torch.Tensor:
    """The position ids to hand the model for (B, N) text positions.

    mrope families expand 2-D positions to 3-D themselves, and then lose the text positions that
    mark where packed sequences start. Given (4, B, N) — text positions, then temporal, height and
    width, which for text-only input all equal the text position — they keep both. (4, B, N)
    positions given (a vision critic's, common.valuehead.multimodal.lay_out) are passed as they are.
    """
    if position_ids.dim() == 3:
        return position_ids
    if uses_multimodal_rope(config):
        return position_ids[None].expand(4, *position_ids.shape)
    return position_ids


def compute_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    model_inputs: dict | None = None,
    *,
    multi_modal_inputs=None,
) -> torch.Tensor:
    """Values [B, T] in float32 (even for a bf16 model), unshifted: entry t is the critic's output
    at position t, the state after token t. For an HL-Gauss critic (common/learning/hl_gauss.py) they are
    the expectations over its bins.

    The value OF token t (what old values and returns are aligned with) is entry t - 1: verl,
    OpenRLHF, trl and NeMo-RL all read it there, and common.engine.shift_to_tokens does the shift.
    Keeping this function unshifted means converting formats never reindexes.

    Packed rows (2-D position_ids restarting at 0 per sequence, from common.parallel.batching) are run with
    attention_mask=None and no cache. Their sequence bounds are stated to our packed attention, and
    transformers' own attentions build a per-sequence mask from the positions. A 2-D padding mask
    would let packed sequences attend to each other, so it is refused unless it is all ones.

    A vision-language critic's images come as model_inputs (pixel_values, image_grid_thw, ...: the
    rows' tensors concatenated) with (4, B, N) position_ids (text, then the multimodal rope's t/h/w),
    both from common.valuehead.multimodal.lay_out; image placeholder tokens get values like any other.
    Or, for padded rows, pass each row's processor outputs as multi_modal_inputs (one dict or None
    per row: pixel_values, image_grid_thw, ...) and the positions are derived here.
    """
    position_ids, model_inputs = _padded_images(model, input_ids, attention_mask, position_ids, model_inputs,
                                                multi_modal_inputs)
    logits = _head_outputs(model, input_ids, attention_mask, position_ids, model_inputs)
    if logits.dim() != 3 or logits.shape[-1] != 1 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for input_ids "
            f"{tuple(input_ids.shape)}; a per-token critic returns [B, T, 1]. "
            f"{'A sequence classifier gives one value per sequence. ' if logits.dim() == 2 else ''}"
            f"Load it with common.valuehead.load_critic, which builds a per-token critic from any "
            f"critic, reward-model or causal-LM checkpoint (and gives an HL-Gauss critic's values, not its bins)."
        )
    return logits.squeeze(-1).float()  # (B, T, 1) -> (B, T)


def compute_bin_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    model_inputs: dict | None = None,
) -> torch.Tensor:
    """An HL-Gauss critic's bin logits [B, T, K] in float32, positioned as compute_values'."""
    support = support_of(model.config)
    if support is None:
        raise ValueError(f"{type(model).__name__} is a scalar critic: it has no bin logits (use compute_values)")
    with bin_logits(model):
        logits = _head_outputs(model, input_ids, attention_mask, position_ids, model_inputs)
    if tuple(logits.shape) != (*input_ids.shape, support.num_bins):
        raise ValueError(f"{type(model).__name__} returned {tuple(logits.shape)} bin logits for input_ids "
                         f"{tuple(input_ids.shape)}; expected [B, T, {support.num_bins}]")
    return logits.float()


def _padded_images(model, input_ids, attention_mask, position_ids, model_inputs, multi_modal_inputs):
    """(position_ids, model_inputs) for padded rows given their per-row multi_modal_inputs (None: the
    rows must hold no image placeholders, unless model_inputs were laid out already)."""
    rows = multimodal.as_rows(multi_modal_inputs, input_ids.shape[0])
    if rows is None:
        if not model_inputs:  # rows holding placeholders need their images: refused, never computed blind
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            multimodal.check_rows(model.config, input_ids.cpu(), mask.cpu(), None)
        return position_ids, model_inputs
    if position_ids is not None or model_inputs:
        raise ValueError("pass either multi_modal_inputs (padded rows; positions derived) or position_ids and "
                         "model_inputs laid out by common.valuehead.multimodal.lay_out, not both")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    host_ids, host_mask = input_ids.cpu(), mask.cpu()
    multimodal.check_rows(model.config, host_ids, host_mask, rows)
    where = host_mask.bool().nonzero(as_tuple=True)
    positions, inputs = multimodal.layout(model, host_ids, host_mask, rows, range(len(rows)),
                                          tuple(input_ids.shape), where)
    return positions.to(input_ids.device), {k: v.to(input_ids.device) for k, v in inputs.items()}


def _head_outputs(model, input_ids, attention_mask, position_ids, model_inputs=None) -> torch.Tensor:
    """The critic's `.logits` on these rows (packed rows with their sequence bounds)."""
    model_inputs = model_inputs or {}
    if model_inputs and position_ids is None:
        raise ValueError("images need the multimodal rope positions: lay the rows out with "
                         "common.valuehead.multimodal.lay_out (or pass multi_modal_inputs to compute_values)")
    text_positions = None if position_ids is None else position_ids[0] if position_ids.dim() == 3 else position_ids
    if text_positions is not None and is_packed(text_positions):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "packed rows (position_ids restart at 0) cannot take a padding attention_mask: a 2-D mask "
                "would mix the packed sequences. Pass attention_mask=None for packed rows."
            )
        attention_mask = None
    if position_ids is None:
        output = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    else:
        with sequence_bounds(text_positions):
            output = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=model_position_ids(model.config, position_ids), use_cache=False,
                           **model_inputs)
    return output.logits
