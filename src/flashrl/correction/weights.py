"""Importance weights, rejection masks and batch normalization (formulas in ``docs/correction.md``).

Follows verl ``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``
(weights and batch normalization) and ``compute_rollout_rejection_mask`` (k1/k2/k3 rejection).
"""

from __future__ import annotations

import math

import torch

from flashrl.correction import metrics as corr_metrics
from flashrl.correction.config import CorrectionConfig
from flashrl.correction.options import BAND_KINDS, ICEPOP_BAND, split_option
from flashrl.correction.ratios import LogRatio

__all__ = [
    "batch_normalize",
    "is_weights",
    "log_or_neg_inf",
    "metric_band",
    "rejection",
    "resolved_band",
    "stat_thresholds",
]


def log_or_neg_inf(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def resolved_band(config: CorrectionConfig) -> tuple[float, float]:
    """The ``(lo, hi)`` band of a ``*_mis`` weight (its default when ``band`` is None)."""
    if config.band is not None:
        return config.band
    return ICEPOP_BAND if config.weight == "token_mis" else (0.0, config.cap)


def is_weights(
    r: LogRatio, config: CorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, T]`` weights, raw weights (before truncation or masking; 0 on padding) and the valid
    tokens whose weight was truncated (``*_tis``) or zeroed (``*_mis``)."""
    v = r.valid
    if config.weight.startswith("seq"):
        raw = v.maskf * r.seq_ell.exp().unsqueeze(-1)
        log_ratio = r.seq_ell.unsqueeze(-1)  # [B, 1], broadcast
    else:
        raw = r.ell.exp().mul_(v.maskf)  # not rho_m1 + 1: that is 0 in fp32 below ~e^-17
        log_ratio = r.ell
    if config.weight == "none":
        return v.maskf, raw, torch.zeros_like(v.mask)
    if config.weight.endswith("tis"):
        return raw.clamp(max=config.cap), raw, (log_ratio > math.log(config.cap)) & v.mask
    lo, hi = resolved_band(config)  # *_mis: compare in log space, exact at the band edges
    inside = (log_ratio >= log_or_neg_inf(lo)) & (log_ratio <= log_or_neg_inf(hi))
    return torch.where(inside, raw, 0.0), raw, ~inside & v.mask


def metric_band(config: CorrectionConfig) -> tuple[float, float]:
    """The ``(lo, hi)`` thresholds of the ``rollout_is_*`` metrics: the band of a ``*_mis`` weight,
    ``(1/C, C)`` otherwise (verl ``compute_is_metrics``: the ``"lo_hi"`` threshold, or ``1/C``)."""
    if config.weight.endswith("mis"):
        return resolved_band(config)
    return 1.0 / config.cap, config.cap


def _token_stat(r: LogRatio, kind: str) -> torch.Tensor:
    """The per-token statistic, 0 on padding; verl's sign convention: k1 = -log rho."""
    if kind == "k1":
        return -r.ell
    if kind == "rho":
        return r.ell
    if kind == "k2":
        return 0.5 * r.ell.square()
    return r.k3


def _seq_stat(stat: torch.Tensor, level: str, n: torch.Tensor) -> torch.Tensor:
    if level == "seq_sum":
        return stat.sum(-1)
    if level == "seq_mean":
        return stat.sum(-1) / n.clamp_min(1.0)
    # seq_max (k2, k3 only): they are >= 0 and 0 on padding, so a plain row max is the masked one
    return stat.amax(-1) if stat.shape[-1] else stat.new_zeros(stat.shape[:-1])


def stat_thresholds(kind: str, lo: float, hi: float) -> tuple[float, float]:
    """``(lower, upper)`` on the statistic itself: ``log`` of a band for k1 and rho, ``(0, hi)``
    for k2 and k3 (verl ``compute_rollout_rejection_mask``)."""
    if kind in BAND_KINDS:
        return log_or_neg_inf(lo), log_or_neg_inf(hi)
    return 0.0, hi


def rejection(
    r: LogRatio, config: CorrectionConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The response mask with rejected tokens removed, and the rejection metrics.

    An option keeps a token (or, at a ``seq_*`` level, every token of a sequence) when its
    statistic lies in ``[lower, upper]`` of ``stat_thresholds`` (k2, k3: ``<= upper``). For k1
    that is ``log(lo) <= -log rho <= log(hi)``, i.e. ``1/hi <= rho <= 1/lo``, verl's rule; for rho
    options ``lo <= rho <= hi``.
    """
    v = r.valid
    if not config.rejection:
        return v.mask, {"rollout_rs_masked_fraction": 0.0, "rollout_rs_seq_masked_fraction": 0.0}
    kept = v.mask
    metrics: dict[str, torch.Tensor | float] = {}
    for option, (lo, hi) in config.rejection_bounds().items():
        level, kind = split_option(option)
        token_stat = _token_stat(r, kind)
        seq_stat = None if level == "token" else _seq_stat(token_stat, level, v.n)
        lower, upper = stat_thresholds(kind, lo, hi)
        stat = token_stat if seq_stat is None else seq_stat
        keep = stat <= upper
        if kind in BAND_KINDS:
            keep &= stat >= lower
        option_kept = (keep if seq_stat is None else keep.unsqueeze(-1)) & v.mask
        kept = kept & option_kept
        metrics.update(
            corr_metrics.rejection_option(
                option, token_stat, seq_stat, option_kept, v, (lower, upper), kind in BAND_KINDS
            )
        )
    kept_n = kept.count_nonzero(-1)
    summary = {
        "rollout_rs_masked_fraction": (v.n - kept_n).sum() / v.n_tokens,
        "rollout_rs_seq_masked_fraction": v.rows_frac(kept_n < v.n),  # over all rows, as verl
    }
    return kept, {**summary, **metrics}


def batch_normalize(
    weights: torch.Tensor, valid: torch.Tensor, config: CorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """Divide by the mean weight over the `valid` tokens (``seq_*`` weights: over the sequences
    with a valid token, each once). `compute_correction` passes every valid token, before
    rejection, as verl's ``compute_rollout_correction_weights`` does: rejection then zeroes
    weights that are already normalized."""
    if config.weight.startswith("seq"):
        valid_seq = valid.any(-1)
        per_seq = weights.amax(-1) if weights.shape[-1] else weights.new_zeros(weights.shape[:-1])
        factor = torch.where(valid_seq, per_seq, 0.0).sum() / valid_seq.count_nonzero().clamp_min(1)
    else:  # weights are 0 on padding
        factor = weights.sum() / valid.count_nonzero().clamp_min(1)
    if factor.item() <= 1e-8:  # nothing (or only zero weights) kept: leave the weights alone
        return weights, 1.0
    return weights / factor, factor
