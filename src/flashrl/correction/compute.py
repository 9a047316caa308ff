"""``compute_correction`` (weights, mask and metrics for one batch) and ``mismatch_metrics``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrl.correction import metrics as corr_metrics
from flashrl.correction import weights as corr_weights
from flashrl.correction.config import CorrectionConfig
from flashrl.correction.ratios import LogRatio
from flashrl.errors import ConfigError, InputError
from flashrl.masked import (
    LOG_RATIO_CLAMP,
    Valid,
    bool_mask,
    check_shapes,
    is_number,
    to_floats,
    valid_float,
)

__all__ = ["DEFAULT_CONFIG", "Correction", "compute_correction", "mismatch_metrics"]

DEFAULT_CONFIG = CorrectionConfig()
"""Decoupled mode, token TIS with C = 2."""


@dataclass
class Correction:
    """Result of ``compute_correction``.

    Attributes:
        weights: ``[B, T]`` fp32, detached: what to multiply into the per-token policy loss. 0 on
            padding and rejected tokens. In decoupled mode these are the IS weights; in bypass mode
            they are 1.0 on kept tokens (the PPO ratio already corrects for the rollout policy).
        mask: ``[B, T]`` response mask with rejected tokens removed, in the input mask's dtype; use
            it for the loss denominators (``*_mis`` zeroed tokens stay in it, rejected ones do not).
        metrics: floats, keys stable for a given config (``docs/correction.md``).
        is_weights: ``[B, T]`` fp32, detached: the IS weights the config computes, 0 on padding and
            rejected tokens. The same tensor as ``weights`` in decoupled mode; in bypass mode they
            are for metrics (or a REINFORCE-style loss, which unlike PPO-clip does apply them).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]
    is_weights: torch.Tensor


@torch.no_grad()
def compute_correction(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    config: CorrectionConfig = DEFAULT_CONFIG,
    old_logprobs: torch.Tensor | None = None,
) -> Correction:
    """IS weights, rejection mask and metrics for one batch.

    Args:
        trainer_logprobs: ``[B, T]`` trainer logprobs of the sampled tokens. In bypass mode: the
            current policy (may require grad; the weights are detached regardless). In decoupled
            mode: the no-grad recompute at the rollout weights, unless ``old_logprobs`` is given.
        rollout_logprobs: ``[B, T]`` fp32 logprobs the engine sampled with (processed logprobs).
        response_mask: ``[B, T]`` bool or 0/1: 1 on trained response tokens. Padding may hold NaN.
        config: see ``CorrectionConfig``.
        old_logprobs: ``[B, T]`` pi_old recompute (decoupled mode). When given, it is the ratio's
            numerator and ``trainer_logprobs`` (e.g. the current policy) is only validated. Bypass
            mode has no separate old policy (pi_old := pi_roll) and raises if it is given.

    Returns:
        ``Correction`` (weights, mask, metrics, is_weights); see its docstring.

    Raises:
        ValueError: shape mismatch (naming both tensors and shapes), a mask value other than 0/1,
            NaN or inf on a valid token (with the count and first position), or ``old_logprobs``
            in bypass mode.
    """
    mask, lp_train, lp_roll = _inputs(
        trainer_logprobs, rollout_logprobs, response_mask, old_logprobs, config.mode
    )
    r = LogRatio.build(lp_train, lp_roll, Valid.of(mask), config.log_ratio_clamp)
    weights, raw, affected = corr_weights.is_weights(r, config)
    metrics = corr_metrics.mismatch(lp_train, lp_roll, r)
    band = corr_weights.metric_band(config)
    metrics.update(corr_metrics.weight_metrics(weights, raw, affected, r, config, band))

    kept, rs_metrics = corr_weights.rejection(r, config)
    factor: torch.Tensor | float = 1.0
    if config.batch_normalize:  # verl's order: over every valid token, before rejection
        weights, factor = corr_weights.batch_normalize(weights, r.valid.mask, config)
    if config.rejection:
        weights = torch.where(kept, weights, 0.0)
    metrics["rollout_is_batch_norm_factor"] = factor
    metrics.update(rs_metrics)

    new_mask = kept if response_mask.dtype == torch.bool else kept.to(response_mask.dtype)
    loss_weights = weights if config.mode == "decoupled" else kept.to(torch.float32)
    return Correction(
        weights=loss_weights, mask=new_mask, metrics=to_floats(metrics), is_weights=weights
    )


def _inputs(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checked inputs of ``compute_correction``: bool mask, ratio numerator and denominator
    (fp32, 0 on padding)."""
    named = {
        "trainer_logprobs": trainer_logprobs,
        "rollout_logprobs": rollout_logprobs,
        "response_mask": response_mask,
    }
    if old_logprobs is not None:
        if mode == "bypass":
            raise InputError(
                "old_logprobs was given in bypass mode, where the ratio is pi_cur / pi_roll and "
                "pi_old := pi_roll; use mode='decoupled' to correct with an old-policy recompute"
            )
        named["old_logprobs"] = old_logprobs
    check_shapes(named)
    mask = bool_mask(response_mask)
    lp_train = valid_float("trainer_logprobs", trainer_logprobs, mask)
    lp_roll = valid_float("rollout_logprobs", rollout_logprobs, mask)
    if old_logprobs is not None:
        lp_train = valid_float("old_logprobs", old_logprobs, mask)
    return mask, lp_train, lp_roll


@torch.no_grad()
def mismatch_metrics(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
) -> dict[str, float]:
    """The mismatch metrics (``kl`` ... ``rollout_is_ratio_fraction_low``) of ``trainer_logprobs``
    against ``rollout_logprobs``; ``cap`` sets the ``[1/cap, cap]`` fraction band."""
    if not (is_number(cap) and cap >= 1.0):
        raise ConfigError(f"cap={cap!r} is invalid; allowed: a number >= 1")
    check_shapes(
        {
            "trainer_logprobs": trainer_logprobs,
            "rollout_logprobs": rollout_logprobs,
            "response_mask": response_mask,
        }
    )
    mask = bool_mask(response_mask)
    lp_train = valid_float("trainer_logprobs", trainer_logprobs, mask)
    lp_roll = valid_float("rollout_logprobs", rollout_logprobs, mask)
    r = LogRatio.build(lp_train, lp_roll, Valid.of(mask), LOG_RATIO_CLAMP)
    metrics = corr_metrics.mismatch(lp_train, lp_roll, r)
    metrics.update(corr_metrics.ratio_fractions(r, False, (1.0 / cap, float(cap))))
    return to_floats(metrics)
