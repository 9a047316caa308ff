"""The PPO-clip policy loss with the rollout-correction weight as a per-token multiplier, and the
loss aggregations.

One tested wrapper for every trainer (correction.md pitfall 10): ``loss = agg(w_t * l_t)`` with DAPO
clip-higher and dual clip. Follows verl ``verl/trainer/ppo/core_algos.py``
(``compute_policy_loss_vanilla``, ``agg_loss``); see ``docs/correction.md`` for the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

__all__ = ["AGGREGATIONS", "aggregate", "ppo_clip_loss"]

AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
"""verl's ``loss_agg_mode`` values (``-`` written ``_``)."""


@dataclass(frozen=True)
class LossOptions:
    """What every policy loss may read (`AlgoConfig` fields, plus the micro-batch's denominator);
    here, below the losses that read it (`flashrl.rl.policy_loss`, `flashrl.rl.gspo`)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    denominator: float | None = None
    """Replaces the outer count of the aggregation (see `aggregate`)."""
    max_length: int | None = None


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    loss_scale_denominator: float | None = None,
    max_length: int | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss with the rollout-correction weight as a per-token multiplier.

    Per valid token, with ``r = exp(clamp(logprobs - old_logprobs))`` and advantage ``A``::

        l = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        l = min(l, -dual_clip * A)   where A < 0, if dual_clip is set
        loss = agg(is_weights * l)

    Pass ``Correction.mask`` and ``Correction.weights``. In bypass mode the latter is the kept-token
    mask: no IS weight multiplies a ratio that already divides by pi_roll (double counting,
    correction.md pitfall 7), so never pass ``Correction.is_weights`` here.

    Args:
        logprobs: ``[B, T]`` current-policy logprobs (with grad).
        old_logprobs: ``[B, T]`` logprobs the PPO ratio is taken against (detached here).
        advantages: ``[B]`` (one per sequence) or ``[B, T]``.
        response_mask: ``[B, T]`` bool or 0/1; padding may hold NaN in any input.
        is_weights: ``[B, T]`` per-token multipliers (detached here), or None for 1.
        clip_low, clip_high: epsilon of the clip range (DAPO clip-higher: 0.2, 0.28).
        dual_clip: c > 1 capping the loss of negative-advantage tokens at ``-c * A`` (DAPO: 10).
        aggregation, loss_scale_denominator, max_length: how the per-token losses reduce to a
            scalar; see ``aggregate``.
        log_ratio_clamp: ``logprobs - old_logprobs`` is clamped to +-this before ``exp``.

    Returns:
        ``(loss, stats)``: a scalar loss with grad, and floats over kept tokens (``pg_loss``,
        ``pg_clipfrac*``, ``ppo_kl``, ``ratio_*``, ``is_weight_mean``; defined in ``_stats``).
    """
    check_loss_options(
        clip_low, clip_high, dual_clip, aggregation, loss_scale_denominator, max_length
    )
    x = LossInputs.build(logprobs, old_logprobs, advantages, response_mask, is_weights)
    ratio = torch.exp(log_ratio := (x.lp - x.lp_old).clamp(-log_ratio_clamp, log_ratio_clamp))
    unclipped = -x.adv * ratio
    clipped = -x.adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = per_token
    if dual_clip is not None:
        dual = torch.where(x.adv < 0, torch.minimum(per_token, -dual_clip * x.adv), per_token)
    weighted = dual if x.w is None else dual * x.w
    loss = aggregate(weighted, x.valid, aggregation, loss_scale_denominator, max_length)

    stats = _stats(x, log_ratio, (unclipped, clipped, per_token, dual), clip_low, clip_high)
    stats["pg_loss"] = loss.detach()
    return loss, to_floats(stats)


@torch.no_grad()
def _stats(
    x: LossInputs,
    log_ratio: torch.Tensor,
    losses: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    clip_low: float,
    clip_high: float,
) -> dict[str, torch.Tensor | float]:
    """The ``ppo_clip_loss`` statistics over valid tokens: ``pg_clipfrac`` (the clip was active),
    ``pg_clipfrac_high`` (``r > 1 + clip_high`` with ``A > 0``), ``pg_clipfrac_low``
    (``r < 1 - clip_low`` with ``A < 0``), ``pg_clipfrac_dual`` (dual clip active), ``ppo_kl``
    (``mean(-clamp(logprobs - old_logprobs))``), ``ratio_mean/max/min``, ``is_weight_mean``."""
    v, log_ratio = x.valid, log_ratio.detach()
    ratio = log_ratio.exp()
    unclipped, clipped, per_token, dual = (t.detach() for t in losses)
    return {
        "pg_clipfrac": v.frac(clipped > unclipped),  # False on padding (A = 0)
        "pg_clipfrac_high": v.frac((ratio > 1.0 + clip_high) & (x.adv > 0)),
        "pg_clipfrac_low": v.frac((ratio < 1.0 - clip_low) & (x.adv < 0)),
        "pg_clipfrac_dual": v.frac(dual < per_token),  # 0 without dual clip (dual is per_token)
        "ppo_kl": -v.mean(log_ratio),  # clamped, as verl's compute_policy_loss_vanilla
        "ratio_mean": v.masked_mean(ratio),  # the ratio is 1 on padding
        "ratio_max": v.max(ratio),
        "ratio_min": v.min(ratio),
        "is_weight_mean": v.mean(x.w) if x.w is not None else 1.0,
    }


@dataclass
class LossInputs:
    """The loss inputs as fp32 with 0 on padding (the old logprobs, advantages and weights
    detached). Zeroing padding before any arithmetic keeps NaN there out of the loss and its
    gradient, and makes the per-token loss 0 on padding (A = 0) without a final mask."""

    valid: Valid
    lp: torch.Tensor
    lp_old: torch.Tensor
    adv: torch.Tensor
    w: torch.Tensor | None

    @classmethod
    def build(
        cls,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        is_weights: torch.Tensor | None,
    ) -> LossInputs:
        named = {"logprobs": logprobs, "old_logprobs": old_logprobs, "response_mask": response_mask}
        if is_weights is not None:
            named["is_weights"] = is_weights
        check_shapes(named)
        if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
            advantages = advantages.unsqueeze(-1).expand_as(logprobs)
        elif advantages.shape != logprobs.shape:
            raise InputError(
                f"shape mismatch: logprobs has shape {tuple(logprobs.shape)} but advantages has "
                f"shape {tuple(advantages.shape)} (expected [B] or [B, T])"
            )
        mask = bool_mask(response_mask)
        return cls(
            valid=Valid.of(mask),
            lp=valid_float("logprobs", logprobs, mask),
            lp_old=valid_float("old_logprobs", old_logprobs.detach(), mask),
            adv=valid_float("advantages", advantages.detach(), mask),
            w=None if is_weights is None else valid_float("is_weights", is_weights.detach(), mask),
        )


def check_loss_options(
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    aggregation: str,
    loss_scale_denominator: float | None,
    max_length: int | None,
) -> None:
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"aggregation={aggregation!r} is invalid; allowed: {AGGREGATIONS}")
    if not (is_number(clip_low) and 0.0 <= clip_low < 1.0) or not (
        is_number(clip_high) and clip_high >= 0.0
    ):
        raise ConfigError(
            f"clip_low={clip_low!r}, clip_high={clip_high!r} are invalid; "
            "allowed: 0 <= clip_low < 1, clip_high >= 0"
        )
    if dual_clip is not None and not (is_number(dual_clip) and dual_clip > 1.0):
        raise ConfigError(
            f"dual_clip={dual_clip!r} is invalid; allowed: None or a number > 1 (DAPO uses 10)"
        )
    if loss_scale_denominator is not None and not (
        is_number(loss_scale_denominator) and loss_scale_denominator > 0
    ):
        raise ConfigError(
            f"loss_scale_denominator={loss_scale_denominator!r} is invalid; "
            "allowed: None or a number > 0"
        )
    if max_length is not None and not (isinstance(max_length, int) and max_length > 0):
        raise ConfigError(f"max_length={max_length!r} is invalid; allowed: None or an int > 0")


def aggregate(
    loss_tok: torch.Tensor,
    v: Valid,
    aggregation: str,
    denominator: float | None,
    max_length: int | None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss (0 on padding) to a scalar over the valid tokens of ``v``.

    ``aggregation`` (verl ``agg_loss`` modes): ``token_mean``: ``sum(l) / #tokens``;
    ``seq_mean_token_mean``: mean over sequences of the per-sequence token mean;
    ``seq_mean_token_sum``: mean over sequences of the token sum; ``seq_mean_token_sum_norm``
    (Dr.GRPO): mean over sequences of ``token_sum / max_length``. Sequence means skip sequences
    without valid tokens. ``denominator`` replaces the outer count (#tokens for ``token_mean``,
    #sequences otherwise), e.g. the count over the whole mini-batch when gradient accumulation
    splits it. ``max_length`` is the constant length of ``seq_mean_token_sum_norm`` (default
    ``T``); pass the configured maximum response length so that differently padded micro-batches
    agree.
    """
    if aggregation == "token_mean":
        total, count = loss_tok.sum(), v.n_tokens
    else:
        seq_sum = loss_tok.sum(-1)
        if aggregation == "seq_mean_token_mean":
            seq_loss = seq_sum / v.n.clamp_min(1.0)
        elif aggregation == "seq_mean_token_sum":
            seq_loss = seq_sum
        else:  # seq_mean_token_sum_norm (Dr.GRPO)
            seq_loss = seq_sum / float(max_length or loss_tok.shape[-1] or 1)
        total, count = seq_loss.sum(), v.n_seqs  # sequences without valid tokens add 0
    return total / (count if denominator is None else denominator)
