"""The PPO value loss, its aggregation modes, and explained variance.

Per token: 0.5 * max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2).
Aggregation follows verl's `agg_loss`, with one addition that matters: `normalizer` is the count
the mode divides by over the *whole mini-batch* (valid tokens or sequences), so the losses (and
gradients) of its micro-batches add up to exactly the mini-batch loss, however it was split.
"""

from __future__ import annotations

import torch

from .hl_gauss import HLGaussSupport, cross_entropy

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_normalizer(response_mask: torch.Tensor, agg_mode: str) -> float:
    """The count `agg_mode` divides by for this (mini-)batch: valid tokens, or sequences with any."""
    _check_mode(agg_mode)
    mask = response_mask.bool()
    if agg_mode == "token-mean":
        return float(mask.sum())
    return float(mask.any(dim=-1).sum())


def _check_mode(agg_mode: str) -> None:
    if agg_mode not in AGG_MODES:
        raise ValueError(f"agg_mode {agg_mode!r} is not one of {', '.join(AGG_MODES)}")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    normalizer: float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss over the valid (response) tokens of [B, T] tensors.

    Args:
      clip_range: eps of the value clip around old_values; None for the unclipped loss.
      agg_mode: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.
      normalizer: what the mode divides by, counted over the whole mini-batch (see
        loss_normalizer); default: this batch's own count.
      horizon: seq-mean-token-sum-norm divides each sequence's token sum by this constant
        (Dr.GRPO); default response_mask.shape[-1]. Keep it fixed across micro-batches.

    Returns (loss, stats); stats: clip_fraction and valid_tokens of this batch. A batch with no
    valid token gives a zero loss that still backpropagates (no NaN). Non-finite returns or old
    values on response tokens are a ValueError.
    """
    mask = response_mask.bool()
    for name, tensor in (("returns", returns), ("old_values", old_values)):
        if not bool(torch.isfinite(tensor[mask]).all()):
            bad = int((~torch.isfinite(tensor[mask])).sum())
            raise ValueError(f"{name} has {bad} non-finite (NaN/inf) entries on response tokens; fix the rollout data")
    loss, clipped, valid = value_loss_terms(values, old_values, returns, response_mask, clip_range=clip_range,
                                            agg_mode=agg_mode, normalizer=normalizer, horizon=horizon)
    valid = int(valid)
    return loss, {"clip_fraction": float(clipped) / valid if valid else 0.0, "valid_tokens": valid}


def value_loss_terms(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None,
    agg_mode: str,
    normalizer: float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """value_loss without host syncs or input checks, for training loops: (loss, count of tokens
    where the clipped term won, count of valid tokens), all tensors on the values' device."""
    _check_mode(agg_mode)
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must have the same [B, T] shape"
        )
    mask = response_mask.bool()
    # Zero the masked positions before squaring so garbage there (even inf) cannot leak as NaN.
    values_m = torch.where(mask, values, torch.zeros_like(values))
    returns_m = torch.where(mask, returns, torch.zeros_like(returns)).to(values.dtype)
    old_m = torch.where(mask, old_values, torch.zeros_like(old_values)).to(values.dtype)
    unclipped = (values_m - returns_m) ** 2
    if clip_range is None:
        per_token = 0.5 * unclipped
        clipped_more = torch.zeros_like(mask)
    else:
        clipped_values = old_m + (values_m - old_m).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns_m) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_more = (clipped > unclipped) & mask

    loss = aggregate(per_token, mask, agg_mode, normalizer, horizon)
    return loss, clipped_more.sum(), mask.sum()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg_mode: str, normalizer: float | None = None,
              horizon: int | None = None) -> torch.Tensor:
    """The agg_mode reduction of [B, T] per-token losses over the valid tokens (see value_loss)."""
    mask = mask.bool()
    weight = mask.to(per_token.dtype)
    if normalizer is None:
        normalizer = loss_normalizer(mask, agg_mode)
    per_token = per_token * weight
    if agg_mode == "token-mean":
        total = per_token.sum()
    else:
        seq_sums = per_token.sum(dim=-1)
        if agg_mode == "seq-mean-token-mean":
            seq_sums = seq_sums / weight.sum(dim=-1).clamp(min=1.0)
        elif agg_mode == "seq-mean-token-sum-norm":
            seq_sums = seq_sums / float(horizon if horizon is not None else mask.shape[-1])
        total = seq_sums.sum()
    return total / normalizer if normalizer > 0 else total * 0.0


def hl_gauss_loss_terms(
    logits: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    support: HLGaussSupport,
    *,
    agg_mode: str,
    normalizer: float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The HL-Gauss loss of [B, T, K] bin logits (already aligned with the tokens, as `values` in
    value_loss_terms): cross-entropy against the targets of `returns` per response token, reduced
    exactly as the MSE loss (agg_mode, whole-mini-batch normaliser). Returns (loss, valid count)."""
    _check_mode(agg_mode)
    if logits.shape[:-1] != returns.shape or returns.shape != response_mask.shape or logits.shape[-1] != support.num_bins:
        raise ValueError(f"logits {tuple(logits.shape)} must be [B, T, {support.num_bins}] over returns "
                         f"{tuple(returns.shape)} and response_mask {tuple(response_mask.shape)}")
    mask = response_mask.bool()
    # Masked positions get a finite return and zero logits: nothing there (even inf) can leak as NaN.
    returns_m = torch.where(mask, returns, torch.zeros_like(returns)).float()
    logits_m = torch.where(mask[..., None], logits, torch.zeros_like(logits))
    per_token = cross_entropy(logits_m, returns_m, support)
    return aggregate(per_token, mask, agg_mode, normalizer, horizon), mask.sum()


def explained_variance_from_sums(n: float, r_sum: float, r_sq: float, res_sum: float, res_sq: float) -> float:
    """1 - Var[R - V] / Var[R] from sums over n tokens of R, R^2, R - V and (R - V)^2, so that the
    sums of several ranks or micro-batches can be added first and the result is exact."""
    if n < 2:
        return float("nan")
    var_r = r_sq / n - (r_sum / n) ** 2
    var_res = res_sq / n - (res_sum / n) ** 2
    return 1.0 - var_res / var_r if var_r > 0 else float("nan")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over valid tokens: 1 is perfect, 0 is no better than a constant."""
    mask = response_mask.bool()
    r = returns[mask].double()
    residual = r - values[mask].double()
    return explained_variance_from_sums(r.numel(), float(r.sum()), float((r * r).sum()),
                                        float(residual.sum()), float((residual * residual).sum()))


def shift_to_tokens(values: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] values (or head outputs) at positions -> predictions for tokens:
    pred[:, t] = values[:, t - 1], pred[:, 0] = 0."""
    return torch.cat([values.new_zeros(values.shape[0], 1, *values.shape[2:]), values[:, :-1]], dim=1)
