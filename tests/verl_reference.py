"""verl's rollout-correction definitions, re-implemented in plain Python floats (float64) as an
independent reference for flashrl's tensors.

Source: verl-project/verl at 1dda039 (2026-08-22). Each function names the verl function whose
formula it implements; the code is written from the formulas (loops over lists), not copied:

- ``offpolicy``: ``compute_offpolicy_metrics`` in ``verl/trainer/ppo/rollout_corr_helper.py``
- ``is_weights``: ``compute_rollout_correction_weights`` and ``compute_is_metrics`` (same file)
- ``batch_normalize``: the batch normalization of ``compute_rollout_correction_weights``, before
  rejection (``compute_rollout_correction_and_rejection_mask``)
- ``rejection``: ``compute_rollout_rejection_mask`` and ``compute_rs_metrics`` (same file)
- ``probs_diff``: ``calculate_debug_metrics`` in ``verl/utils/debug/metrics.py``
- ``agg_loss``: ``agg_loss`` in ``verl/trainer/ppo/core_algos.py`` (single process: dp_size 1,
  no global batch info)

verl's ``masked_mean`` divides by ``count + 1e-8``; here by ``count`` (a relative 1e-8 for a
non-empty set) and an empty set gives 0, as it does in verl. Per-sequence statistics run over all
rows, a row without valid tokens contributing its masked mean 0, as in verl.

flashrl extension: ``*_rho`` rejection options (not in verl) are the k1 rule with the statistic
``log rho`` instead of ``-log rho``.
"""

from __future__ import annotations

import math

SAFETY_BOUND = 20.0

Rows = list[list[float]]


def clamp(x: float, bound: float = SAFETY_BOUND) -> float:
    return max(-bound, min(bound, x))


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def unbiased_std(xs: list[float]) -> float:
    """``torch.std`` (Bessel-corrected); verl reports 0 for a single value."""
    if len(xs) < 2:
        return 0.0
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def moment_std(xs: list[float]) -> float:
    """verl's clamped std: ``sqrt(max(E[x^2] - E[x]^2, 0))``, 0 for fewer than 2 values."""
    if len(xs) < 2:
        return 0.0
    return math.sqrt(max(mean([x * x for x in xs]) - mean(xs) ** 2, 0.0))


def _valid(rows: Rows, mask: list[list[bool]]) -> list[list[float]]:
    return [
        [x for x, m in zip(row, mrow, strict=True) if m]
        for row, mrow in zip(rows, mask, strict=True)
    ]


def offpolicy(train: Rows, roll: Rows, mask: list[list[bool]]) -> dict[str, float]:
    """verl ``compute_offpolicy_metrics``: ``train`` is verl's ``old_log_prob`` (the ratio's
    numerator), ``roll`` its ``rollout_log_prob``."""
    tr, ro = _valid(train, mask), _valid(roll, mask)
    mean_tr = [mean(r) for r in tr]  # masked_mean(axis=-1): 0 for an empty row
    mean_ro = [mean(r) for r in ro]
    toks = [(a, b) for rt, rr in zip(tr, ro, strict=True) for a, b in zip(rt, rr, strict=True)]
    diff = [r - t for t, r in zip(mean_tr, mean_ro, strict=True)]  # log_ppl_diff per row
    sums = [sum(a - b for a, b in zip(rt, rr, strict=True)) for rt, rr in zip(tr, ro, strict=True)]
    return {
        "training_ppl": mean([math.exp(-x) for x in mean_tr]),
        "training_log_ppl": mean([-x for x in mean_tr]),
        "kl": mean([b - a for a, b in toks]),
        "k3_kl": mean([math.exp(a - b) - (a - b) - 1 for a, b in toks]),
        "rollout_ppl": mean([math.exp(-x) for x in mean_ro]),
        "rollout_log_ppl": mean([-x for x in mean_ro]),
        "log_ppl_diff": mean(diff),
        "log_ppl_abs_diff": mean([abs(x) for x in diff]),
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": mean([math.exp(x) for x in diff]),
        "chi2_token": mean([math.exp(clamp(a - b)) ** 2 for a, b in toks]) - 1.0,
        "chi2_seq": mean([math.exp(2.0 * clamp(s)) for s in sums]) - 1.0,
    }


def probs_diff(train: Rows, roll: Rows, mask: list[list[bool]]) -> dict[str, float]:
    """verl ``calculate_debug_metrics`` (logged there as ``training/rollout_probs_diff_*``)."""
    pt = [math.exp(x) for r in _valid(train, mask) for x in r]
    pr = [math.exp(x) for r in _valid(roll, mask) for x in r]
    diff = [abs(a - b) for a, b in zip(pt, pr, strict=True)]
    return {
        "rollout_probs_diff_max": max(diff),
        "rollout_probs_diff_mean": mean(diff),
        "rollout_probs_diff_std": unbiased_std(diff),
    }


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``rollout_is_threshold``: a number C (TIS) or ``"lo_hi"`` (IcePop) -> (upper, lower)."""
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_", 1)
        return float(hi), float(lo)
    return float(spec), None


def is_weights(
    train: Rows, roll: Rows, mask: list[list[bool]], level: str, threshold: float | str
) -> tuple[Rows, dict[str, float]]:
    """verl ``compute_rollout_correction_weights`` (no batch normalization) with
    ``compute_is_metrics``: the IS weights (0 on padding) and their metrics."""
    upper, lower = parse_is_threshold(threshold)
    lo_thr = 1.0 / upper if lower is None else lower
    B = len(mask)
    lr = [
        [(a - b) if m else 0.0 for a, b, m in zip(ta, rb, mr, strict=True)]
        for ta, rb, mr in zip(train, roll, mask, strict=True)
    ]
    sums = [sum(row) for row in lr]  # masked_sum: the unclamped sequence log-ratio
    raw, w = [], []
    for i in range(B):
        r_row, w_row = [], []
        for t, m in enumerate(mask[i]):
            x = math.exp(clamp(lr[i][t] if level == "token" else sums[i])) if m else 0.0
            r_row.append(x)
            if lower is None:
                w_row.append(min(x, upper))
            else:
                w_row.append(x if lower <= x <= upper else 0.0)
        raw.append(r_row)
        w.append(w_row)
    return w, is_metrics(
        w, raw, mask, sums, level == "sequence", (lo_thr, upper), lower is not None
    )


def batch_normalize(w: Rows, mask: list[list[bool]], level: str) -> tuple[Rows, float]:
    """verl ``compute_rollout_correction_weights`` with ``rollout_is_batch_normalize=True`` (one
    process), applied to the weights ``w`` before any rejection, as verl's
    ``compute_rollout_correction_and_rejection_mask`` does (step 2, then the rejection mask of step
    3 only shrinks the response mask): divide by the mean of ``w`` over every valid token
    (``"token"``), or over the rows with a valid token of each row's masked-mean weight
    (``"sequence"``). A mean <= 1e-8 leaves the weights alone and reports factor 1."""
    rows = _valid(w, mask)
    if level == "token":
        vals = [x for r in rows for x in r]
    else:
        vals = [mean(r) for r in rows if r]
    factor = mean(vals)
    if not factor > 1e-8:
        return w, 1.0
    return [[x / factor for x in row] for row in w], factor


def is_metrics(
    w: Rows,
    raw: Rows,
    mask: list[list[bool]],
    sums: list[float],
    sequence: bool,
    band: tuple[float, float],
    icepop: bool,
) -> dict[str, float]:
    """verl ``compute_is_metrics`` of weights ``w`` with raw weights ``raw`` (both 0 on padding),
    the unclamped sequence log-ratios ``sums`` and the ``(lower, upper)`` thresholds."""
    lo_thr, upper = band
    vw = [x for wr, mr in zip(w, mask, strict=True) for x, m in zip(wr, mr, strict=True) if m]
    vraw = [x for rr, mr in zip(raw, mask, strict=True) for x, m in zip(rr, mr, strict=True) if m]
    out: dict[str, float] = {"rollout_is_mean": mean(vw)}
    if sequence:
        out["rollout_is_max"] = math.exp(min(max(sums), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(min(sums))
        out["rollout_is_ratio_fraction_high"] = mean([float(s > math.log(upper)) for s in sums])
        out["rollout_is_ratio_fraction_low"] = mean([float(s < log(lo_thr)) for s in sums])
    else:
        out["rollout_is_ratio_fraction_high"] = mean([float(x > upper) for x in vraw])
        out["rollout_is_ratio_fraction_low"] = mean([float(x < lo_thr) for x in vraw])
        out["rollout_is_max"] = max(vw)
        out["rollout_is_min"] = min(vw)
    clamped = [min(max(x, 0.0), upper) for x in vw]
    out["rollout_is_std"] = moment_std(clamped)
    mu = mean(clamped)
    second = mean([(x / (mu + 1e-8)) ** 2 for x in clamped])
    # verl divides by zero when every weight is 0; flashrl reports 0 there
    out["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0
    seq_w = [mean(r) for r in _valid(w, mask)]
    seq_raw = [mean(r) for r in _valid(raw, mask)]
    out["rollout_is_seq_mean"] = mean(seq_w)
    out["rollout_is_seq_std"] = unbiased_std(seq_w)
    out["rollout_is_seq_max"] = max(seq_w)
    out["rollout_is_seq_min"] = min(seq_w)
    out["rollout_is_seq_max_deviation"] = max(abs(x - 1.0) for x in seq_w)
    out["rollout_is_seq_fraction_high"] = mean([float(x > upper) for x in seq_raw])
    out["rollout_is_seq_fraction_low"] = mean([float(x < lo_thr) for x in seq_raw])
    if icepop:
        out["rollout_is_oob_ratio"] = mean([float(x < lo_thr or x > upper) for x in vraw])
    return out


def log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _token_stat(kind: str, lr: float) -> float:
    ell = clamp(lr)
    return {
        "k1": -ell,
        "rho": ell,  # flashrl extension
        "k2": 0.5 * ell * ell,
        "k3": math.exp(ell) - 1.0 - ell,
    }[kind]


def rejection(
    train: Rows,
    roll: Rows,
    mask: list[list[bool]],
    options: list[str],
    thresholds: list[float | str],
) -> tuple[list[list[bool]], dict[str, float]]:
    """verl ``compute_rollout_rejection_mask``: the kept response mask (options AND-combined) and
    the ``rollout_rs_*`` metrics. ``thresholds`` holds one spec per option: ``"lo_hi"`` or a
    number x (``(1/x, x)``) for k1/rho options, an upper bound for k2/k3."""
    toks = [(i, t) for i, row in enumerate(mask) for t, m in enumerate(row) if m]
    keep_all = [[bool(m) for m in row] for row in mask]
    out: dict[str, float] = {}
    for option, spec in zip(options, thresholds, strict=True):
        keep, metrics = _rejection_option(train, roll, mask, option, spec)
        out.update(metrics)
        keep_all = [
            [ka and k for ka, k in zip(kar, kr, strict=True)]
            for kar, kr in zip(keep_all, keep, strict=True)
        ]
    out["rollout_rs_masked_fraction"] = mean([float(not keep_all[i][t]) for i, t in toks])
    out["rollout_rs_seq_masked_fraction"] = mean(  # over all rows
        [
            float(any(m and not k for m, k in zip(mr, kr, strict=True)))
            for mr, kr in zip(mask, keep_all, strict=True)
        ]
    )
    return keep_all, out


def _bounds(kind: str, spec: float | str) -> tuple[bool, float, float]:
    """(two-sided, lower, upper) on the statistic, as verl's threshold parsing gives them."""
    if kind in ("k1", "rho"):
        lo, hi = (float(x) for x in spec.split("_")) if isinstance(spec, str) else (1 / spec, spec)
        return True, math.log(lo), math.log(hi)
    return False, 0.0, float(spec)


def _rejection_option(
    train: Rows, roll: Rows, mask: list[list[bool]], option: str, spec: float | str
) -> tuple[list[list[bool]], dict[str, float]]:
    """One option: its keep mask and verl ``compute_rs_metrics`` plus the masked fractions."""
    B = len(mask)
    valid_rows = [i for i in range(B) if any(mask[i])]
    toks = [(i, t) for i in range(B) for t, m in enumerate(mask[i]) if m]
    level, kind = option.rsplit("_", 1)
    two_sided, lower, upper = _bounds(kind, spec)
    stat = [
        [_token_stat(kind, a - b) if m else 0.0 for a, b, m in zip(ta, rb, mr, strict=True)]
        for ta, rb, mr in zip(train, roll, mask, strict=True)
    ]
    row_vals = _valid(stat, mask)
    seq_stat = None
    per_token = stat
    if level != "token":
        agg = {"seq_sum": sum, "seq_mean": mean, "seq_max": lambda xs: max(xs, default=0.0)}
        seq_stat = [agg[level](r) for r in row_vals]
        per_token = [[seq_stat[i]] * len(mask[i]) for i in range(B)]
    keep = [[(lower <= x <= upper) if two_sided else x <= upper for x in row] for row in per_token]
    ptv = [per_token[i][t] for i, t in toks]
    seq_values = seq_stat if seq_stat is not None else [mean(r) for r in row_vals]
    svv = [seq_values[i] for i in valid_rows]
    stat_for_extremes = svv if seq_stat is not None else ptv  # sequence level: over valid rows
    p = f"rollout_rs_{option}"
    out = {
        f"{p}_mean": mean(ptv),
        f"{p}_max": max(stat_for_extremes),
        f"{p}_min": min(stat_for_extremes),
        f"{p}_fraction_high": mean([float(x > upper) for x in stat_for_extremes]),
        f"{p}_fraction_low": (
            mean([float(x < lower) for x in stat_for_extremes]) if two_sided else 0.0
        ),
        f"{p}_std": moment_std([min(max(x, lower if two_sided else 0.0), upper) for x in ptv]),
        f"{p}_seq_mean": mean(svv),
        f"{p}_seq_std": unbiased_std(svv),
        f"{p}_seq_max": max(svv),
        f"{p}_seq_min": min(svv),
        f"{p}_seq_max_deviation": max(abs(x) for x in svv),
        f"{p}_seq_fraction_high": mean([float(x > upper) for x in svv]),
        f"{p}_masked_fraction": mean([float(not keep[i][t]) for i, t in toks]),
        f"{p}_seq_masked_fraction": mean(
            [
                float(any(m and not k for m, k in zip(mask[i], keep[i], strict=True)))
                for i in valid_rows
            ]
        ),
    }
    if two_sided:
        out[f"{p}_seq_fraction_low"] = mean([float(x < lower) for x in svv])
    return keep, out


def agg_loss(
    loss_mat: Rows, mask: list[list[bool]], mode: str, loss_scale_factor: float | None = None
) -> float:
    """verl ``agg_loss`` (dp_size 1, ``batch_num_tokens`` / ``global_batch_size`` not given):
    ``seq-mean-token-sum-norm`` divides the mean over non-empty sequences of the token sums by
    ``loss_scale_factor`` (default: the padded length T); since verl PR #5417 (2026-02-26; before
    it, the sum over sequences was divided by T only)."""
    rows = _valid(loss_mat, mask)
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(x for r in rows for x in r) / sum(len(r) for r in rows)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = sum(sum(r) for r in nonempty) / len(nonempty)
        if mode == "seq-mean-token-sum-norm":
            loss /= loss_scale_factor if loss_scale_factor is not None else len(mask[0])
        return loss
    if mode == "seq-mean-token-mean":
        return sum(mean(r) for r in nonempty) / len(nonempty)
    raise ValueError(mode)
