"""Mismatch, IS-weight and rejection metrics; a name shared with verl means what it means in verl.

Transcribed from verl ``verl/trainer/ppo/rollout_corr_helper.py`` (verl-project/verl 1dda039):
``compute_offpolicy_metrics`` (``mismatch``), ``compute_is_metrics`` (``weight_metrics``),
``compute_rs_metrics`` and ``compute_rollout_rejection_mask`` (``rejection_option``); the
``rollout_probs_diff_*`` metrics follow ``verl/utils/debug/metrics.py``. Formulas, the remaining
differences and flashrl's extra metrics are in ``docs/correction.md``. verl's convention for
per-sequence means is kept: they run over all rows, and a row without valid tokens counts with its
masked mean 0 (log-ppl 0, ppl 1, weight 0).
"""

from __future__ import annotations

import math

import torch

from flashrl.correction.config import CorrectionConfig
from flashrl.correction.ratios import LogRatio
from flashrl.masked import Valid

__all__ = ["mismatch", "ratio_fractions", "rejection_option", "weight_metrics"]

Metrics = dict[str, torch.Tensor | float]


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def mismatch(lp_train: torch.Tensor, lp_roll: torch.Tensor, r: LogRatio) -> Metrics:
    """``kl`` ... ``token_mult_prob_error`` for logprobs that are 0 on padding."""
    v, delta = r.valid, r.delta
    neg_log_g = -v.row_mean(delta)  # mean_t lp_roll - mean_t lp_train per row; 0 for an empty row
    train_log_ppl, roll_log_ppl = -v.row_mean(lp_train), -v.row_mean(lp_roll)
    p_train, p_roll = lp_train.exp().mul_(v.maskf), lp_roll.exp().mul_(v.maskf)
    prob_diff = (p_train - p_roll).abs_()
    diff_mean = v.mean(prob_diff)
    diff_max = prob_diff.amax() if prob_diff.numel() else prob_diff.new_zeros(())  # 0 on padding
    pearson = _pearson(p_train, p_roll, v)
    return {
        "kl": -v.mean(delta),
        "k3_kl": r.k3_sum_unclamped() / v.n_tokens,
        "chi2_token": v.mean((r.rho_m1 + 2.0).mul_(r.rho_m1)),  # rho^2 - 1 without cancellation
        "chi2_seq": v.rows_mean(torch.expm1(2.0 * r.seq_ell)),
        "training_log_ppl": v.rows_mean(train_log_ppl),
        "training_ppl": v.rows_mean(train_log_ppl.exp()),
        "rollout_log_ppl": v.rows_mean(roll_log_ppl),
        "rollout_ppl": v.rows_mean(roll_log_ppl.exp()),
        "log_ppl_diff": v.rows_mean(neg_log_g),
        "log_ppl_abs_diff": v.rows_mean(neg_log_g.abs()),
        "log_ppl_diff_max": v.rows_max(neg_log_g),
        "log_ppl_diff_min": v.rows_min(neg_log_g),
        "ppl_ratio": v.rows_mean(neg_log_g.exp()),
        "rollout_probs_diff_max": diff_max,
        "rollout_probs_diff_mean": diff_mean,
        "rollout_probs_diff_std": v.sample_std(prob_diff, diff_mean),
        "rollout_actor_probs_pearson_corr": pearson,
        "token_mult_prob_error": v.mean(delta.abs()).exp(),
    }


def _pearson(a: torch.Tensor, b: torch.Tensor, v: Valid) -> torch.Tensor:
    """Pearson correlation over valid tokens of a and b (both 0 on padding), in float64.

    NaN when either is constant over the valid tokens (so also for a single token), as verl's
    ``torch.corrcoef`` and numpy give: a correlation with a constant is undefined. Constancy is
    checked on the values themselves; the centred values of a constant input can keep a rounding
    residue, which would give +-1. No valid token at all gives 0.0, as every metric of an empty
    set does."""
    constant = (v.max(a) == v.min(a)) | (v.max(b) == v.min(b))
    constant &= v.mask.any()
    maskd = v.maskf.double()
    da = (a.double() - v.mean(a.double())).mul_(maskd).flatten()
    db = (b.double() - v.mean(b.double())).mul_(maskd).flatten()
    cov, denom = torch.dot(da, db), (torch.dot(da, da) * torch.dot(db, db)).sqrt()
    pearson = (cov / denom.clamp_min(1e-300)).clamp(-1.0, 1.0).float()
    return torch.where(constant, math.nan, pearson)


def ratio_fractions(r: LogRatio, sequence: bool, band: tuple[float, float]) -> Metrics:
    """``rollout_is_ratio_fraction_high/low``: the fraction of valid tokens whose clamped ratio
    ``rho_t`` lies above ``hi`` / below ``lo``; for sequence-level weights the fraction of all
    rows whose unclamped ``S_i`` lies above ``log(hi)`` / below ``log(lo)`` (verl)."""
    v, (lo, hi) = r.valid, band
    if sequence:
        return {
            "rollout_is_ratio_fraction_high": v.rows_frac(r.seq_delta > _log(hi)),
            "rollout_is_ratio_fraction_low": v.rows_frac(r.seq_delta < _log(lo)),
        }
    # ell is 0 on padding and log(lo) <= 0 <= log(hi), so padding never counts
    return {
        "rollout_is_ratio_fraction_high": v.frac(r.ell > _log(hi)),
        "rollout_is_ratio_fraction_low": v.frac(r.ell < _log(lo)),
    }


def weight_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    affected: torch.Tensor,
    r: LogRatio,
    config: CorrectionConfig,
    band: tuple[float, float],
) -> Metrics:
    """``rollout_is_*`` statistics of the weights the config computes (before rejection and batch
    normalization). ``raw`` is the weight before truncation or masking, ``affected`` the valid
    tokens whose weight was truncated or zeroed, ``band`` the ``(lo, hi)`` metric thresholds."""
    v, (lo, hi) = r.valid, band
    w_c = weights.clamp(0.0, hi)  # verl: clamp(min=0, max=threshold) for std and ESS
    mean_c = v.mean(w_c)
    flat = w_c.flatten()
    w_seq, raw_seq = v.row_mean(weights), v.row_mean(raw)  # 0 for an empty row
    sequence = config.weight.startswith("seq")
    out: Metrics = {
        "rollout_is_mean": v.mean(weights),
        "rollout_is_max": v.max(weights),
        "rollout_is_min": v.min(weights),
        "rollout_is_std": v.std(w_c, mean_c),
        "rollout_is_eff_sample_size": mean_c.square()
        / (torch.dot(flat, flat) / v.n_tokens).clamp_min(1e-30),
        "rollout_is_seq_mean": v.rows_mean(w_seq),
        "rollout_is_seq_std": v.rows_std(w_seq),
        "rollout_is_seq_max": v.rows_max(w_seq),
        "rollout_is_seq_min": v.rows_min(w_seq),
        "rollout_is_seq_max_deviation": v.rows_max((w_seq - 1.0).abs()),
        "rollout_is_seq_fraction_high": v.rows_frac(raw_seq > hi),
        "rollout_is_seq_fraction_low": v.rows_frac(raw_seq < lo),
        "rollout_is_clipped_fraction": v.frac(affected) if config.weight.endswith("tis") else 0.0,
        "rollout_is_oob_ratio": v.frac(affected) if config.weight.endswith("mis") else 0.0,
    }
    if sequence and r.seq_delta.numel():
        # the product ratio before truncation, over all rows, from the unclamped sums S_i; verl
        # clamps the max at e^20, flashrl also the min (exp would overflow when every S_i > 88)
        bound = config.log_ratio_clamp
        out["rollout_is_max"] = v.rows_max(r.seq_delta).clamp(max=bound).exp()
        out["rollout_is_min"] = v.rows_min(r.seq_delta).clamp(max=bound).exp()
    out.update(ratio_fractions(r, sequence, band))
    return out


def rejection_option(
    option: str,
    token_stat: torch.Tensor,
    seq_stat: torch.Tensor | None,
    kept: torch.Tensor,
    v: Valid,
    thresholds: tuple[float, float],
    two_sided: bool,
) -> Metrics:
    """``rollout_rs_<option>_*`` for one rejection option (verl ``compute_rs_metrics`` plus the
    masked fractions of ``compute_rollout_rejection_mask``).

    ``token_stat`` is the ``[B, T]`` statistic (0 on padding), ``seq_stat`` the ``[B]`` one of a
    ``seq_*`` option (None for ``token_*``), ``kept`` the valid tokens the option keeps,
    ``thresholds`` the ``(lower, upper)`` bounds on the statistic, ``two_sided`` whether the lower
    one applies (k1 and rho options).
    """
    p, (lower, upper) = f"rollout_rs_{option}", thresholds
    lower = lower if two_sided else 0.0
    if seq_stat is None:
        extremes = (v.max(token_stat), v.min(token_stat))
        high, low = v.frac((token_stat > upper) & v.mask), v.frac((token_stat < lower) & v.mask)
        seq_values = v.row_mean(token_stat)  # per sequence: the mean over its tokens
        mean = v.mean(token_stat)
        clamped = token_stat.clamp(lower, upper).mul_(v.maskf)
        std = v.std(clamped, v.mean(clamped))
    else:
        extremes = (v.seq_max(seq_stat), v.seq_min(seq_stat))
        high, low = v.seq_frac(seq_stat > upper), v.seq_frac(seq_stat < lower)
        seq_values = seq_stat
        # per token: verl broadcasts the row's value to its tokens, i.e. weights rows by length
        mean = (seq_stat * v.n).sum() / v.n_tokens
        clamped = seq_stat.clamp(lower, upper)
        c_mean = (clamped * v.n).sum() / v.n_tokens
        std = ((clamped - c_mean).square() * v.n).sum().div(v.n_tokens).sqrt()
    rejected = v.mask & ~kept
    out: Metrics = {
        f"{p}_masked_fraction": v.frac(rejected),
        f"{p}_seq_masked_fraction": v.seq_frac(rejected.any(-1)),
        f"{p}_mean": mean,
        f"{p}_max": extremes[0],
        f"{p}_min": extremes[1],
        f"{p}_fraction_high": high,
        f"{p}_fraction_low": low if two_sided else 0.0,
        f"{p}_std": std,
        f"{p}_seq_mean": v.seq_mean(seq_values),
        f"{p}_seq_std": v.seq_std(seq_values),
        f"{p}_seq_max": v.seq_max(seq_values),
        f"{p}_seq_min": v.seq_min(seq_values),
        f"{p}_seq_max_deviation": v.seq_max(seq_values.abs()),
        f"{p}_seq_fraction_high": v.seq_frac(seq_values > upper),
    }
    if two_sided:
        out[f"{p}_seq_fraction_low"] = v.seq_frac(seq_values < lower)
    return out
