"""Mismatch and IS-weight metrics (the tables and formulas are in ``docs/correction.md``).

Follows verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_offpolicy_metrics``,
``compute_is_metrics``) and ``verl/utils/debug/metrics.py`` (``rollout_probs_diff_*``).
"""

from __future__ import annotations

import math

import torch

from flashrl.correction.config import CorrectionConfig
from flashrl.correction.ratios import LogRatio
from flashrl.masked import Valid

__all__ = ["mismatch", "weight_metrics"]


def mismatch(
    lp_train: torch.Tensor, lp_roll: torch.Tensor, r: LogRatio, cap: float
) -> dict[str, torch.Tensor | float]:
    """``kl`` ... ``rollout_is_ratio_fraction_low`` for logprobs that are 0 on padding."""
    v, delta = r.valid, r.delta
    n = v.n.clamp_min(1.0)
    neg_log_g = -r.seq_delta / n  # mean_t lp_roll - mean_t lp_train, per sequence
    train_log_ppl, roll_log_ppl = -lp_train.sum(-1) / n, -lp_roll.sum(-1) / n
    p_train, p_roll = lp_train.exp().mul_(v.maskf), lp_roll.exp().mul_(v.maskf)
    prob_diff = (p_train - p_roll).abs_()
    diff_mean = v.mean(prob_diff)
    diff_max = (
        prob_diff.amax() if prob_diff.numel() else prob_diff.new_zeros(())
    )  # >= 0, and 0 on padding
    pearson = _pearson(
        p_train, p_roll, v, equal=diff_max == 0
    )  # last use of p_train, p_roll: centers them
    log_cap = math.log(cap)  # >= 0, so the comparisons below are False on padding (delta = 0)
    return {
        "kl": -v.mean(delta),
        "k3_kl": r.k3_sum_unclamped() / v.n_tokens,
        "chi2_token": v.mean((r.rho_m1 + 2.0).mul_(r.rho_m1)),  # rho^2 - 1 without cancellation
        "chi2_seq": v.seq_mean(torch.expm1(2.0 * r.seq_ell)),
        "training_log_ppl": v.seq_mean(train_log_ppl),
        "training_ppl": v.seq_mean(train_log_ppl.exp()),
        "rollout_log_ppl": v.seq_mean(roll_log_ppl),
        "rollout_ppl": v.seq_mean(roll_log_ppl.exp()),
        "log_ppl_diff": v.seq_mean(neg_log_g),
        "log_ppl_abs_diff": v.seq_mean(neg_log_g.abs()),
        "log_ppl_diff_max": v.seq_max(neg_log_g),
        "log_ppl_diff_min": v.seq_min(neg_log_g),
        "ppl_ratio": v.seq_mean(neg_log_g.exp()),
        "rollout_probs_diff_max": diff_max,
        "rollout_probs_diff_mean": diff_mean,
        "rollout_probs_diff_std": v.std(prob_diff, diff_mean),
        "rollout_actor_probs_pearson_corr": pearson,
        "token_mult_prob_error": v.mean(delta.abs()).exp(),
        "rollout_is_ratio_fraction_high": v.frac(delta > log_cap),
        "rollout_is_ratio_fraction_low": v.frac(delta < -log_cap),
    }


def _pearson(a: torch.Tensor, b: torch.Tensor, v: Valid, equal: torch.Tensor) -> torch.Tensor:
    """Pearson correlation over valid tokens of a and b (both 0 on padding; centered in place)."""
    da = a.sub_(v.mean(a)).mul_(v.maskf).flatten()
    db = b.sub_(v.mean(b)).mul_(v.maskf).flatten()
    cov, denom = torch.dot(da, db), (torch.dot(da, da) * torch.dot(db, db)).sqrt()
    # Constant inputs have no correlation coefficient; report 1.0 when they also agree (no
    # mismatch).
    return torch.where(denom > 0, cov / denom.clamp_min(1e-30), equal.float())


def weight_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    affected: torch.Tensor,
    r: LogRatio,
    config: CorrectionConfig,
) -> dict[str, torch.Tensor | float]:
    """``rollout_is_*`` statistics of the weights the config computes (before rejection and batch
    normalization); ``raw`` and ``affected`` as returned by ``weights.is_weights``."""
    v, cap = r.valid, config.cap
    w_bar = weights.clamp(1.0 / cap, cap).mul_(v.maskf)
    mean_bar = v.mean(w_bar)
    flat = w_bar.flatten()
    ess = mean_bar.square() / (torch.dot(flat, flat) / v.n_tokens).clamp_min(1e-30)
    n = v.n.clamp_min(1.0)
    w_seq, raw_seq = weights.sum(-1) / n, raw.sum(-1) / n  # both are 0 on padding
    affected_fraction = v.frac(affected)
    return {
        "rollout_is_mean": v.mean(weights),
        "rollout_is_std": v.std(w_bar, mean_bar),
        "rollout_is_max": v.max(weights),
        "rollout_is_min": v.min(weights),
        "rollout_is_eff_sample_size": ess,
        "rollout_is_seq_mean": v.seq_mean(w_seq),
        "rollout_is_seq_std": v.seq_std(w_seq),
        "rollout_is_seq_max": v.seq_max(w_seq),
        "rollout_is_seq_min": v.seq_min(w_seq),
        "rollout_is_seq_max_deviation": v.seq_max((w_seq - 1.0).abs()),
        "rollout_is_seq_fraction_high": v.seq_frac(raw_seq > cap),
        "rollout_is_seq_fraction_low": v.seq_frac(raw_seq < 1.0 / cap),
        "rollout_is_clipped_fraction": affected_fraction if config.weight.endswith("tis") else 0.0,
        "rollout_is_oob_ratio": affected_fraction if config.weight.endswith("mis") else 0.0,
    }
