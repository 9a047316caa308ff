"""Tests for flashrl.correction: each mode against a plain loop reference, property tests, hand-computed
metrics, the zero-mismatch identity, bad inputs, and the PPO-clip helper. Metrics that share a name
with verl are checked against ``verl_reference`` (verl's definitions in float64, issue 17); weights
and masks against the loops below."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_reference as verl
from flashrl.correction import (
    ICEPOP_BAND,
    REJECTION_OPTIONS,
    WEIGHTS,
    CorrectionConfig,
    compute_correction,
    mismatch_metrics,
)
from flashrl.rl.loss import AGGREGATIONS, ppo_clip_loss

# ---------------------------------------------------------------------------------------------------
# Plain-Python references (loops over lists, math module; no tensor ops)


def _clamp(x: float, bound: float = 20.0) -> float:
    return max(-bound, min(bound, x))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _pstd(xs: list[float]) -> float:
    mu = _mean(xs)
    return math.sqrt(_mean([(x - mu) ** 2 for x in xs])) if xs else 0.0


def _k_stat(kind: str, delta: float) -> float:
    ell = _clamp(delta)
    return {"k1": -ell, "rho": ell, "k2": ell * ell / 2, "k3": math.exp(ell) - 1 - ell}[kind]


def ref_correction(
    train, roll, mask, cfg: CorrectionConfig, bounds: dict[str, tuple[float, float]]
):
    """Returns (weights, kept, pre-rejection weights, raw weights, per-option keep, per-option stats)."""
    cap = cfg.cap
    band = cfg.band or ((0.5, 5.0) if cfg.weight == "token_mis" else (0.0, cap))
    B, T = len(mask), len(mask[0]) if mask else 0
    w0 = [[0.0] * T for _ in range(B)]
    raw = [[0.0] * T for _ in range(B)]
    kept = [[bool(mask[i][t]) for t in range(T)] for i in range(B)]
    opt_keep = {o: [[True] * T for _ in range(B)] for o in bounds}
    opt_stats: dict[str, list[float]] = {o: [] for o in bounds}
    for i in range(B):
        valid = [t for t in range(T) if mask[i][t]]
        delta = {t: train[i][t] - roll[i][t] for t in valid}
        seq_rho = math.exp(_clamp(sum(delta.values())))
        for t in valid:
            rho = math.exp(_clamp(delta[t]))
            r = seq_rho if cfg.weight.startswith("seq") else rho
            raw[i][t] = r
            if cfg.weight == "none":
                w0[i][t] = 1.0
            elif cfg.weight.endswith("tis"):
                w0[i][t] = min(r, cap)
            else:
                w0[i][t] = r if band[0] <= r <= band[1] else 0.0
        for option, (lo, hi) in bounds.items():
            level, kind = option.rsplit("_", 1)
            stats = {t: _k_stat(kind, delta[t]) for t in valid}

            def ok(s, kind=kind, lo=lo, hi=hi):
                # k1 (verl): lo <= exp(k1) = 1/rho <= hi; rho: lo <= rho <= hi; k2, k3: s <= hi
                return lo <= math.exp(s) <= hi if kind in ("k1", "rho") else s <= hi

            if level == "token":
                for t in valid:
                    opt_keep[option][i][t] = ok(stats[t])
                    opt_stats[option].append(stats[t])
            elif valid:
                values = list(stats.values())
                s = {"seq_sum": sum(values), "seq_mean": _mean(values), "seq_max": max(values)}[
                    level
                ]
                opt_stats[option].append(s)
                for t in valid:
                    opt_keep[option][i][t] = ok(s)
            for t in valid:
                kept[i][t] = kept[i][t] and opt_keep[option][i][t]
    # verl's order: batch normalization over every valid token (every sequence with one), then
    # rejection zeroes the normalized weights of rejected tokens
    factor = 1.0
    if cfg.batch_normalize:
        if cfg.weight.startswith("seq"):  # one value per sequence with a valid token
            vals = [
                next(w0[i][t] for t in range(T) if mask[i][t]) for i in range(B) if any(mask[i])
            ]
        else:
            vals = [w0[i][t] for i in range(B) for t in range(T) if mask[i][t]]
        if _mean(vals) > 1e-8:
            factor = _mean(vals)
    w = [[w0[i][t] / factor if kept[i][t] else 0.0 for t in range(T)] for i in range(B)]
    return w, kept, w0, raw, opt_keep, opt_stats, factor


def ref_mismatch(train, roll, mask, cap: float) -> dict[str, float]:
    """verl's off-policy and probability-diff metrics, flashrl's extras by loops, and the
    token-level ratio fractions of the band [1/cap, cap]."""
    toks = [
        (train[i][t], roll[i][t])
        for i in range(len(mask))
        for t in range(len(mask[i]))
        if mask[i][t]
    ]
    p_tr = [math.exp(a) for a, _ in toks]
    p_ro = [math.exp(b) for _, b in toks]
    mu_a, mu_b = _mean(p_tr), _mean(p_ro)
    cov = _mean([(x - mu_a) * (y - mu_b) for x, y in zip(p_tr, p_ro, strict=True)])
    den = _pstd(p_tr) * _pstd(p_ro)
    out = {**verl.offpolicy(train, roll, mask), **verl.probs_diff(train, roll, mask)}
    constant = len(set(p_tr)) == 1 or len(set(p_ro)) == 1  # verl's torch.corrcoef: NaN
    out["rollout_actor_probs_pearson_corr"] = math.nan if constant else cov / den if toks else 0.0
    out["token_mult_prob_error"] = math.exp(_mean([abs(a - b) for a, b in toks]))
    _, token_is = verl.is_weights(train, roll, mask, "token", cap)
    for key in ("rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low"):
        out[key] = token_is[key]
    return out


def ref_metrics(train, roll, mask, cfg: CorrectionConfig, bounds) -> dict[str, float]:
    """Every key compute_correction returns: verl's definitions (``verl_reference``) for the names
    verl has, loops for flashrl's own."""
    cap = cfg.cap
    _, kept, w0, raw, *_, factor = ref_correction(train, roll, mask, cfg, bounds)
    B, T = len(mask), len(mask[0]) if mask else 0
    vidx = [(i, t) for i in range(B) for t in range(T) if mask[i][t]]
    band = cfg.band or ((0.5, 5.0) if cfg.weight == "token_mis" else (0.0, cap))
    metric_band = band if cfg.weight.endswith("mis") else (1 / cap, cap)
    sums = [sum(train[i][t] - roll[i][t] for t in range(T) if mask[i][t]) for i in range(B)]
    out = ref_mismatch(train, roll, mask, cap)
    out.update(
        verl.is_metrics(w0, raw, mask, sums, cfg.weight.startswith("seq"), metric_band, False)
    )
    out.update(
        {
            "rollout_is_clipped_fraction": (
                _mean([float(raw[i][t] > cap) for i, t in vidx])
                if cfg.weight.endswith("tis")
                else 0.0
            ),
            "rollout_is_oob_ratio": (
                _mean([float(not band[0] <= raw[i][t] <= band[1]) for i, t in vidx])
                if cfg.weight.endswith("mis")
                else 0.0
            ),
            "rollout_is_batch_norm_factor": factor,
            "rollout_rs_masked_fraction": 0.0,
            "rollout_rs_seq_masked_fraction": 0.0,
        }
    )
    if cfg.rejection:
        specs = [
            f"{lo!r}_{hi!r}" if o.endswith(("k1", "rho")) else hi for o, (lo, hi) in bounds.items()
        ]
        verl_kept, rs = verl.rejection(train, roll, mask, list(bounds), specs)
        assert verl_kept == kept  # the loop reference above agrees with verl's rule
        out.update(rs)
    return out


# ---------------------------------------------------------------------------------------------------
# Inputs


def random_batch(
    gen: torch.Generator, B: int = 7, T: int = 11, scale: float = 0.5, extreme: bool = True
):
    """Rollout logprobs, trainer logprobs and a ragged right-padded mask with an empty and a full row.
    Padding holds NaN and -1 (FlashRL's old padding sentinel) to prove it is ignored."""
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0], lengths[1] = 0, T
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    roll = -torch.rand(B, T, generator=gen) * 4
    delta = torch.randn(B, T, generator=gen) * scale
    if extreme:
        delta[2, 0], delta[-1, 0] = 30.0, -30.0  # beyond the +-20 clamp
    train = (roll + delta).clamp(max=0.0)
    train[~mask] = float("nan")
    roll[~mask] = -1.0
    return train, roll, mask


def explicit_bounds(cfg: CorrectionConfig, thresholds: dict) -> dict[str, tuple[float, float]]:
    """Thresholds spelled out for the reference, independent of CorrectionConfig.rejection_bounds."""
    out = {}
    for option in cfg.rejection:
        spec = thresholds[option]
        if option.endswith(("k1", "rho")):
            out[option] = spec if isinstance(spec, tuple) else (1 / spec, spec)
        else:
            out[option] = (0.0, spec)
    return out


THRESHOLDS = {
    "token_k1": (0.6, 1.6),  # asymmetric on purpose (correction.md pitfall 2)
    "token_k2": 0.3,
    "token_k3": 0.2,
    "seq_sum_k1": (0.3, 4.0),
    "seq_sum_k2": 1.5,
    "seq_sum_k3": 1.0,
    "seq_mean_k1": (0.8, 1.3),
    "seq_mean_k2": 0.15,
    "seq_mean_k3": 0.1,
    "seq_max_k2": 1.0,
    "seq_max_k3": 0.8,
    "token_rho": (0.6, 1.6),
    "seq_sum_rho": (0.3, 4.0),
    "seq_mean_rho": (0.8, 1.3),
}


def make_config(**kw) -> CorrectionConfig:
    options = kw.get("rejection", ())
    if options:
        kw["rejection_thresholds"] = tuple(THRESHOLDS[o] for o in options)
    return CorrectionConfig(**kw)


REFERENCE_CONFIGS = [
    *[make_config(weight=w) for w in WEIGHTS],
    make_config(weight="token_tis", cap=1.3),
    make_config(weight="token_mis", band=(0.7, 1.4)),
    make_config(weight="seq_mis", band=(0.5, 2.0)),
    *[make_config(weight="token_tis", rejection=(o,)) for o in REJECTION_OPTIONS],
    make_config(
        weight="token_tis", rejection=("token_k1", "seq_mean_k1", "seq_mean_k3", "seq_max_k2")
    ),
    make_config(weight="seq_tis", cap=5.0, rejection=("seq_sum_k1",)),
    make_config(weight="token_tis", batch_normalize=True),
    make_config(weight="token_mis", batch_normalize=True, rejection=("token_k2",)),
    make_config(weight="seq_tis", batch_normalize=True, rejection=("seq_mean_k1",)),
    make_config(weight="seq_mis", band=(0.3, 3.0), batch_normalize=True),
    make_config(mode="bypass", weight="token_tis", rejection=("seq_max_k3",)),
]


def _close(actual: float, expected: float, key: str, rel: float = 1e-4, abs_: float = 2e-5) -> None:
    if math.isnan(expected):
        assert math.isnan(actual), f"{key}: got {actual!r}, expected NaN"
        return
    assert math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_), (
        f"{key}: got {actual!r}, expected {expected!r}"
    )


# ---------------------------------------------------------------------------------------------------
# Every mode against the reference


@pytest.mark.parametrize(
    "cfg",
    REFERENCE_CONFIGS,
    ids=lambda c: f"{c.mode}-{c.weight}-{'+'.join(c.rejection)}-bn{int(c.batch_normalize)}",
)
def test_matches_loop_reference(cfg: CorrectionConfig, gen: torch.Generator) -> None:
    train, roll, mask = random_batch(gen)
    bounds = explicit_bounds(cfg, THRESHOLDS)
    corr = compute_correction(train, roll, mask, cfg)
    lists = (train.tolist(), roll.tolist(), mask.tolist())
    w, kept, *_ = ref_correction(*lists, cfg, bounds)

    assert corr.mask.tolist() == kept
    torch.testing.assert_close(corr.is_weights, torch.tensor(w), rtol=2e-6, atol=1e-7)
    expected_loss_weights = (
        torch.tensor(w) if cfg.mode == "decoupled" else torch.tensor(kept).float()
    )
    torch.testing.assert_close(corr.weights, expected_loss_weights, rtol=2e-6, atol=1e-7)

    expected = ref_metrics(*lists, cfg, bounds)
    assert set(corr.metrics) == set(expected)
    for key, value in expected.items():
        _close(corr.metrics[key], value, key)


def test_reference_inputs_exercise_rejection_and_truncation(gen: torch.Generator) -> None:
    """Guards the reference test: the random batch must actually truncate, mask and reject."""
    train, roll, mask = random_batch(gen)
    m = compute_correction(train, roll, mask, make_config(rejection=tuple(THRESHOLDS))).metrics
    assert 0 < m["rollout_rs_masked_fraction"] < 1
    assert m["rollout_is_clipped_fraction"] > 0
    for option in THRESHOLDS:
        assert m[f"rollout_rs_{option}_masked_fraction"] > 0, option
    mis = compute_correction(
        train, roll, mask, make_config(weight="token_mis", band=(0.7, 1.4))
    ).metrics
    assert 0 < mis["rollout_is_oob_ratio"] < 1


def test_asymmetric_rho_band_bounds_rho_not_its_inverse() -> None:
    """correction.md pitfall 2: verl's k1 rule with (0.6, 1.6) keeps 1/1.6 <= rho <= 1/0.6; the
    rho options state the band on rho itself (token_k1 follows verl: tests/test_correction_verl.py)."""
    rho = torch.tensor([[0.61, 1.59, 1.65, 0.55]])
    roll = torch.full_like(rho, -2.0)
    corr = compute_correction(
        roll + rho.log(),
        roll,
        torch.ones_like(rho, dtype=torch.bool),
        CorrectionConfig(rejection=("token_rho",), rejection_thresholds=((0.6, 1.6),)),
    )
    assert corr.mask.tolist() == [[True, True, False, False]]


def test_geometric_rejection_is_length_invariant() -> None:
    """1.1 per token over 100 tokens: product ~13,780 (Seq-MIS rejects, Seq-TIS caps), G = 1.1 (Geo-RS keeps)."""
    roll = torch.full((1, 100), -1.0)
    train = roll + math.log(1.1)
    mask = torch.ones(1, 100, dtype=torch.bool)
    geo = compute_correction(
        train, roll, mask, CorrectionConfig(rejection=("seq_mean_k1",), rejection_thresholds=(1.2,))
    )
    seq = compute_correction(
        train, roll, mask, CorrectionConfig(rejection=("seq_sum_k1",), rejection_thresholds=(1.2,))
    )
    assert geo.mask.all() and not seq.mask.any()
    _close(geo.metrics["rollout_rs_seq_mean_k1_mean"], -math.log(1.1), "geo k1")
    _close(seq.metrics["rollout_rs_seq_sum_k1_mean"], -100 * math.log(1.1), "seq k1")
    seq_tis = compute_correction(train, roll, mask, CorrectionConfig(weight="seq_tis", cap=1e5))
    _close(seq_tis.weights[0, 0].item(), 1.1**100, "product", rel=1e-4)
    _close(1.1**100, 13780.6, "1.1^100", rel=1e-4)


def test_default_thresholds() -> None:
    cfg = CorrectionConfig(
        cap=3.0, rejection=("token_k1", "seq_sum_k1", "seq_mean_k1", "seq_mean_k3")
    )
    assert cfg.rejection_bounds() == {
        "token_k1": (1 / 3.0, 3.0),
        "seq_sum_k1": (0.5, 2.0),
        "seq_mean_k1": (0.999, 1.001),
        "seq_mean_k3": (0.0, 0.01),
    }
    broadcast = CorrectionConfig(
        rejection=("token_k1", "seq_mean_k1"), rejection_thresholds=(1.25,)
    )
    assert broadcast.rejection_bounds() == {"token_k1": (0.8, 1.25), "seq_mean_k1": (0.8, 1.25)}


def test_mask_dtype_and_zero_one_masks(gen: torch.Generator) -> None:
    train, roll, mask = random_batch(gen)
    cfg = make_config(rejection=("token_k1",))
    ref = compute_correction(train, roll, mask, cfg)
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        corr = compute_correction(train, roll, mask.to(dtype), cfg)
        assert corr.mask.dtype == dtype
        assert torch.equal(corr.mask.bool(), ref.mask)
        assert torch.equal(corr.weights, ref.weights)


def test_decoupled_ratio_uses_old_logprobs(gen: torch.Generator) -> None:
    """With old_logprobs the ratio is pi_old / pi_roll; trainer_logprobs (current policy) only get validated."""
    train, roll, mask = random_batch(gen)
    corr = compute_correction(train, roll, mask, CorrectionConfig(), old_logprobs=roll.clone())
    assert torch.equal(corr.weights, mask.float())
    direct = compute_correction(train, roll, mask, CorrectionConfig())
    via_old = compute_correction(
        torch.zeros_like(train), roll, mask, CorrectionConfig(), old_logprobs=train
    )
    assert torch.equal(direct.weights, via_old.weights) and direct.metrics == via_old.metrics


def test_bypass_applies_no_is_weight_but_keeps_rejection(gen: torch.Generator) -> None:
    train, roll, mask = random_batch(gen)
    cfg = make_config(mode="bypass", rejection=("token_k1",))
    corr = compute_correction(train, roll, mask, cfg)
    assert torch.equal(corr.weights, corr.mask.float())  # PPO ratio already divides by pi_roll
    assert not torch.equal(corr.is_weights, corr.weights)  # computed, for metrics
    assert corr.mask.sum() < mask.sum()
    decoupled = compute_correction(train, roll, mask, make_config(rejection=("token_k1",)))
    assert torch.equal(corr.is_weights, decoupled.weights) and corr.metrics == decoupled.metrics


def test_batch_normalize_gives_unit_mean(gen: torch.Generator) -> None:
    """Mean 1 over every valid token (every sequence with one), before rejection (verl's order):
    rejection then only zeroes weights, so the kept tokens keep the weights and factor they have
    without rejection."""
    train, roll, mask = random_batch(gen)
    plain = compute_correction(train, roll, mask, make_config(batch_normalize=True))
    _close(plain.weights[mask].mean().item(), 1.0, "token mean", rel=1e-6)
    assert plain.metrics["rollout_is_batch_norm_factor"] != 1.0
    rejected = compute_correction(
        train, roll, mask, make_config(batch_normalize=True, rejection=("token_k1",))
    )
    assert 0 < rejected.metrics["rollout_rs_masked_fraction"] < 1
    factor = "rollout_is_batch_norm_factor"
    assert rejected.metrics[factor] == plain.metrics[factor]
    assert torch.equal(rejected.weights, torch.where(rejected.mask, plain.weights, 0.0))
    seq = compute_correction(
        train, roll, mask, make_config(weight="seq_tis", cap=5.0, batch_normalize=True)
    )
    per_seq = [row[m].max().item() for row, m in zip(seq.weights, seq.mask, strict=True) if m.any()]
    _close(sum(per_seq) / len(per_seq), 1.0, "sequence mean", rel=1e-6)


def test_token_weights_reach_e_minus_20(gen: torch.Generator) -> None:
    """A ratio at (or beyond) the clamp e^-20 gets weight e^-20 ~ 2.06e-9, not 0 (rho - 1 + 1
    rounds to 0 in fp32 there); the docstring's [e^-20, e^20]."""
    roll = torch.full((1, 4), -1.0)
    train = roll + torch.tensor([[-20.0, -25.0, -17.0, 20.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    for weight in ("token_tis", "token_mis"):
        cfg = CorrectionConfig(
            weight=weight, cap=1e9, band=(0.0, 1e9) if weight == "token_mis" else None
        )
        w = compute_correction(train, roll, mask, cfg).weights[0].double()
        expected = torch.tensor([-20.0, -20.0, -17.0, 20.0], dtype=torch.float64).exp()
        torch.testing.assert_close(w, expected, rtol=1e-6, atol=0)


def test_mis_keeps_tokens_in_mask_while_rejection_removes_them(gen: torch.Generator) -> None:
    """correction.md pitfall 4: IcePop zeroes the weight, the token stays in the denominator."""
    train, roll, mask = random_batch(gen)
    mis = compute_correction(
        train, roll, mask, CorrectionConfig(weight="token_mis", band=(0.7, 1.4))
    )
    rs = compute_correction(
        train,
        roll,
        mask,
        CorrectionConfig(rejection=("token_rho",), rejection_thresholds=((0.7, 1.4),)),
    )
    zeroed = mask & (mis.weights == 0)
    assert zeroed.any()
    assert torch.equal(mis.mask, mask)
    assert torch.equal(rs.mask, mask & ~zeroed)


# ---------------------------------------------------------------------------------------------------
# Identity: identical trainer and rollout logprobs


IDENTITY_CONFIGS = [
    *[CorrectionConfig(weight=w) for w in WEIGHTS],
    *[make_config(rejection=(o,)) for o in REJECTION_OPTIONS],
    CorrectionConfig(
        rejection=("token_k1", "seq_sum_k1", "seq_mean_k1", "seq_mean_k3")
    ),  # documented defaults
    CorrectionConfig(weight="seq_tis", batch_normalize=True),
    CorrectionConfig(weight="token_mis", batch_normalize=True),
    CorrectionConfig(mode="bypass", rejection=("seq_mean_k1",)),
]


@pytest.mark.parametrize(
    "cfg",
    IDENTITY_CONFIGS,
    ids=lambda c: f"{c.mode}-{c.weight}-{'+'.join(c.rejection)}-bn{int(c.batch_normalize)}",
)
def test_identical_logprobs_are_the_identity(cfg: CorrectionConfig, gen: torch.Generator) -> None:
    _, roll, mask = random_batch(gen)
    corr = compute_correction(roll.clone(), roll, mask, cfg)
    assert torch.equal(corr.weights, mask.float())
    assert torch.equal(corr.is_weights, mask.float())
    assert torch.equal(corr.mask, mask)
    m = corr.metrics
    for key in (
        "kl",
        "k3_kl",
        "chi2_token",
        "chi2_seq",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "rollout_probs_diff_max",
        "rollout_probs_diff_mean",
        "rollout_is_ratio_fraction_high",
        "rollout_is_ratio_fraction_low",
        "rollout_is_clipped_fraction",
        "rollout_is_oob_ratio",
        "rollout_rs_masked_fraction",
        "rollout_rs_seq_masked_fraction",
        "rollout_is_std",
    ):
        assert m[key] == 0.0, key
    # verl's per-sequence means run over all rows: the empty row 0 has weight 0, deviation 1
    assert not mask[0].any() and m["rollout_is_seq_max_deviation"] == 1.0
    rows = compute_correction(roll[1:].clone(), roll[1:], mask[1:], cfg).metrics
    assert (
        rows["rollout_is_seq_max_deviation"] == 0.0 and rows["rollout_is_seq_fraction_low"] == 0.0
    )
    for key in (
        "ppl_ratio",
        "rollout_is_eff_sample_size",
        "rollout_is_mean",
        "rollout_is_max",
        "rollout_is_min",
        "token_mult_prob_error",
        "rollout_actor_probs_pearson_corr",
        "rollout_is_batch_norm_factor",
    ):
        assert m[key] == 1.0, key
    _close(m["training_ppl"], m["rollout_ppl"], "ppl", rel=1e-6)


# ---------------------------------------------------------------------------------------------------
# Metrics on hand-computed examples


def test_metrics_hand_computed() -> None:
    """Sequence 0: p_train = (1/2, 1/4), p_roll = (1/4, 1/4), so rho = (2, 1). Sequence 1 is padding
    (with NaN). Sequence 2: one token, rho = 1/4. Per-sequence means run over all three rows, the
    empty one counting with log-ppl 0 (ppl 1, sequence ratio 1) and IS weight 0, as in verl."""
    ln = math.log
    train = torch.tensor([[ln(0.5), ln(0.25)], [float("nan"), 0.0], [ln(0.125), 0.0]])
    roll = torch.tensor([[ln(0.25), ln(0.25)], [-1.0, float("nan")], [ln(0.5), 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    m = compute_correction(train, roll, mask, CorrectionConfig(cap=2.0)).metrics
    expected = {
        # tokens: delta = (ln 2, 0, -ln 4); rho = (2, 1, 1/4)
        "kl": (-ln(2) + 0 + ln(4)) / 3,
        "k3_kl": ((2 - 1 - ln(2)) + 0 + (0.25 - 1 + ln(4))) / 3,
        "chi2_token": (4 + 1 + 1 / 16) / 3 - 1,
        "chi2_seq": (2**2 + 1 + 0.25**2) / 3 - 1,  # sequence ratios 2, (empty) 1, 1/4
        "training_ppl": (2**1.5 + 1 + 8) / 3,  # exp(-mean lp): (2^(3/2), 1, 8)
        "rollout_ppl": (4 + 1 + 2) / 3,
        "training_log_ppl": (1.5 * ln(2) + 0 + ln(8)) / 3,
        "ppl_ratio": (2**1.5 / 4 + 1 + 8 / 2) / 3,  # mean of PPL_train / PPL_roll
        "log_ppl_diff": (-0.5 * ln(2) + 0 + ln(4)) / 3,
        "log_ppl_diff_max": ln(4),
        "log_ppl_diff_min": -0.5 * ln(2),
        "rollout_probs_diff_max": 0.375,
        "rollout_probs_diff_mean": (0.25 + 0 + 0.375) / 3,
        "rollout_probs_diff_std": math.sqrt(
            ((0.25 - 0.625 / 3) ** 2 + (0.625 / 3) ** 2 + (0.375 - 0.625 / 3) ** 2) / 2
        ),
        "token_mult_prob_error": math.exp((ln(2) + ln(4)) / 3),
        "rollout_is_ratio_fraction_high": 0.0,  # rho = 2 is not > C = 2
        "rollout_is_ratio_fraction_low": 1 / 3,  # rho = 1/4 < 1/2
        # token TIS weights (2, 1, 1/4); std and ESS on clamp(w, 0, C) = (2, 1, 1/4)
        "rollout_is_mean": (2 + 1 + 0.25) / 3,
        "rollout_is_max": 2.0,
        "rollout_is_min": 0.25,
        "rollout_is_eff_sample_size": 3.25**2 / (3 * (4 + 1 + 0.0625)),
        "rollout_is_std": math.sqrt((4 + 1 + 0.0625) / 3 - (3.25 / 3) ** 2),
        "rollout_is_seq_mean": (1.5 + 0 + 0.25) / 3,  # per-row weights 1.5, 0 (empty), 0.25
        "rollout_is_seq_max_deviation": 1.0,  # the empty row
        "rollout_is_seq_fraction_low": 2 / 3,  # raw per-row means 1.5, 0, 0.25 below 1/2
    }
    for key, value in expected.items():
        _close(m[key], value, key, rel=1e-6, abs_=1e-7)


def test_metrics_zero_mismatch_hand_computed() -> None:
    """Identical logprobs, constant probability 1/e on every valid token, one padded row."""
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, float("nan"), 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    m = compute_correction(
        lp, lp.nan_to_num(-7.0), mask, CorrectionConfig(weight="seq_tis")
    ).metrics
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "rollout_probs_diff_max"):
        assert m[key] == 0.0, key
    for key in (
        "rollout_is_eff_sample_size",
        "ppl_ratio",
        "token_mult_prob_error",
        "rollout_is_seq_mean",
    ):
        assert m[key] == 1.0, key
    # constant (and equal): a correlation with a constant is undefined, NaN as in verl and numpy
    assert math.isnan(m["rollout_actor_probs_pearson_corr"])
    _close(m["training_ppl"], math.e, "training_ppl", rel=1e-6)
    _close(m["rollout_log_ppl"], 1.0, "rollout_log_ppl", rel=1e-6)
    # constant trainer probabilities against varying rollout ones: NaN as well
    other = mismatch_metrics(
        lp.nan_to_num(0.0), torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]]), mask
    )
    assert math.isnan(other["rollout_actor_probs_pearson_corr"])


@pytest.mark.parametrize("value", [0.3, 0.7, 1 / 3, 0.1, 0.9])
def test_pearson_of_two_unequal_constants_is_nan(value: float) -> None:
    """Two unequal constant probability vectors (fp32 centring leaves a rounding residue that
    gave 1.0), a constant against a varying one, and a single token: NaN, as verl's
    ``torch.corrcoef`` and ``numpy.corrcoef`` give; two varying vectors still match numpy."""
    mask = torch.ones(3, 37, dtype=torch.bool)
    train = torch.full((3, 37), math.log(value))
    roll = torch.full((3, 37), math.log(value / 2))
    varying = roll + torch.linspace(-0.5, 0.0, 37)
    for a, b, m in ((train, roll, mask), (train, varying, mask)):
        assert math.isnan(mismatch_metrics(a, b, m)["rollout_actor_probs_pearson_corr"])
        with np.errstate(invalid="ignore", divide="ignore"):
            assert np.isnan(
                np.corrcoef(a.exp().flatten().double(), b.exp().flatten().double())[0, 1]
            )
    single = mismatch_metrics(train[:1, :1], roll[:1, :1], mask[:1, :1])
    assert math.isnan(single["rollout_actor_probs_pearson_corr"])
    varying_train = train + torch.linspace(-1.0, 0.0, 37) ** 2
    got = mismatch_metrics(varying_train, varying, mask)["rollout_actor_probs_pearson_corr"]
    expected = np.corrcoef(varying_train.exp().flatten().double(), varying.exp().flatten().double())
    _close(got, expected[0, 1], "pearson", rel=1e-6)


def test_sequence_level_clamps_the_sum_not_the_terms() -> None:
    """delta = (30, -15): clamp(sum) = 15, while clamping the terms first would give 20 - 15 = 5."""
    roll = torch.tensor([[-40.0, -1.0]])
    train = roll + torch.tensor([[30.0, -15.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    corr = compute_correction(train, roll, mask, CorrectionConfig(weight="seq_tis", cap=1e9))
    _close(corr.weights[0, 0].item(), math.exp(15.0), "seq weight", rel=1e-5)
    _close(corr.metrics["chi2_seq"], math.expm1(30.0), "chi2_seq", rel=1e-5)
    token = compute_correction(train, roll, mask, CorrectionConfig(weight="token_tis", cap=1e9))
    _close(token.weights[0, 0].item(), math.exp(20.0), "token weight clamped at e^20", rel=1e-5)


def test_chi2_and_ess_small_mismatch_precision() -> None:
    """expm1-based formulas keep small mismatches measurable (rho^2 - 1 would cancel in fp32)."""
    roll = torch.full((4, 64), -1.0)
    train = roll + 1e-4
    m = mismatch_metrics(train, roll, torch.ones(4, 64))
    _close(m["chi2_token"], math.expm1(2e-4), "chi2_token", rel=1e-3)
    _close(m["k3_kl"], 0.5e-8, "k3_kl", rel=1e-2, abs_=0)
    _close(m["kl"], -1e-4, "kl", rel=1e-3)


def test_mismatch_metrics_standalone_matches_reference(gen: torch.Generator) -> None:
    train, roll, mask = random_batch(gen)
    m = mismatch_metrics(train, roll, mask, cap=1.5)
    expected = ref_mismatch(train.tolist(), roll.tolist(), mask.tolist(), 1.5)
    assert set(m) == set(expected)
    for key, value in expected.items():
        _close(m[key], value, key)


@pytest.mark.parametrize(
    "shape", [(0, 5), (3, 0), (3, 4)], ids=["empty-batch", "no-tokens", "all-padding"]
)
def test_empty_and_all_padding_give_no_nan(shape: tuple[int, int]) -> None:
    train = torch.full(shape, float("nan"))
    mask = torch.zeros(shape, dtype=torch.bool)
    cfg = make_config(
        weight="seq_tis", batch_normalize=True, rejection=("token_k1", "seq_max_k2", "seq_mean_k1")
    )
    corr = compute_correction(train, train, mask, cfg)
    assert corr.weights.shape == shape and corr.mask.shape == shape
    assert all(math.isfinite(v) for v in corr.metrics.values()), corr.metrics
    assert corr.metrics["kl"] == 0.0 and corr.metrics["rollout_is_eff_sample_size"] == 0.0
    loss, stats = ppo_clip_loss(
        train.requires_grad_(), train, torch.zeros(shape[0]), mask, corr.weights
    )
    loss.backward()
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in stats.values())


# ---------------------------------------------------------------------------------------------------
# Properties


CONFIGS_FOR_PROPERTIES = [
    *[CorrectionConfig(weight=w) for w in WEIGHTS],
    CorrectionConfig(weight="token_mis", band=(0.8, 1.5)),
    CorrectionConfig(weight="seq_mis", band=(0.2, 3.0)),
    make_config(weight="token_tis", cap=3.0, rejection=("token_k1", "seq_mean_k3", "seq_max_k2")),
    make_config(weight="seq_tis", batch_normalize=True, rejection=("seq_sum_k1",)),
    make_config(weight="token_mis", batch_normalize=True, rejection=("token_k3", "seq_mean_k1")),
    make_config(mode="bypass", rejection=("seq_sum_k2", "token_k2")),
]


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    flat = st.lists(st.floats(-30.0, 0.0, width=32), min_size=B * T, max_size=B * T)
    roll = torch.tensor(draw(flat)).view(B, T)
    delta = torch.tensor(
        draw(st.lists(st.floats(-25.0, 25.0, width=32), min_size=B * T, max_size=B * T))
    ).view(B, T)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).view(B, T)
    train = roll + delta
    return train.masked_fill(~mask, float("nan")), roll.masked_fill(~mask, -1.0), mask


@settings(max_examples=150, deadline=None)
@given(batch=batches(), cfg=st.sampled_from(CONFIGS_FOR_PROPERTIES), extra=st.integers(1, 5))
def test_weight_properties(batch, cfg: CorrectionConfig, extra: int) -> None:
    train, roll, mask = batch
    train.requires_grad_(True)
    corr = compute_correction(train, roll, mask, cfg)
    w = corr.is_weights
    # finite, non-negative, zero on padding and rejected tokens; rejection only removes tokens
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert (w[~corr.mask] == 0).all() and (corr.weights[~corr.mask] == 0).all()
    assert not (corr.mask & ~mask).any()
    # detached: no graph hangs off the weights even when the inputs require grad
    assert not w.requires_grad and w.grad_fn is None and not corr.weights.requires_grad
    # Pearson: NaN (undefined) where either probability vector is constant, one token say
    p_train, p_roll = (set(x.detach()[mask].exp().tolist()) for x in (train, roll))
    pearson = corr.metrics.pop("rollout_actor_probs_pearson_corr")
    assert math.isnan(pearson) == (bool(p_train) and min(len(p_train), len(p_roll)) == 1)
    assert all(math.isfinite(v) for v in corr.metrics.values())
    # bounds (batch normalization rescales on purpose, so only without it)
    if not cfg.batch_normalize:
        kept = w[corr.mask]
        if cfg.weight.endswith("tis"):
            assert (kept <= cfg.cap).all()
        elif cfg.weight == "none":
            assert (kept == 1).all()
        else:
            lo, hi = cfg.band or (ICEPOP_BAND if cfg.weight == "token_mis" else (0.0, cfg.cap))
            nonzero = kept[kept != 0]
            assert ((nonzero >= lo * (1 - 1e-6)) & (nonzero <= hi * (1 + 1e-6))).all()
    # invariant to padding length: extra padding columns (holding NaN) change nothing
    pad = torch.full((train.shape[0], extra), float("nan"))
    longer = compute_correction(
        torch.cat([train.detach(), pad], 1),
        torch.cat([roll, pad], 1),
        torch.cat([mask, torch.zeros_like(pad, dtype=torch.bool)], 1),
        cfg,
    )
    # Sums over a longer row group differently; exp turns their last-bit changes into relative errors of
    # about |sum of |delta|| * 1e-7 (here < 2e-5). A padding leak would show as NaN or O(1) changes.
    T = train.shape[1]
    torch.testing.assert_close(longer.weights[:, :T], corr.weights, rtol=1e-4, atol=0)
    assert (longer.weights[:, T:] == 0).all() and torch.equal(longer.mask[:, :T], corr.mask)
    for key, value in corr.metrics.items():
        _close(longer.metrics[key], value, key, rel=1e-4, abs_=1e-6)


@settings(max_examples=60, deadline=None)
@given(batch=batches(), cfg=st.sampled_from(CONFIGS_FOR_PROPERTIES))
def test_identity_property(batch, cfg: CorrectionConfig) -> None:
    _, roll, mask = batch
    corr = compute_correction(roll.clone(), roll, mask, cfg)
    assert torch.equal(corr.weights, mask.float()) and torch.equal(corr.mask, mask)
    assert corr.metrics["kl"] == 0.0 and corr.metrics["chi2_token"] == 0.0


# ---------------------------------------------------------------------------------------------------
# Bad input


def test_shape_mismatch_names_both_tensors_and_shapes() -> None:
    a, b = torch.zeros(2, 5), torch.zeros(2, 6)
    with pytest.raises(
        ValueError,
        match=r"trainer_logprobs has shape \(2, 5\) but rollout_logprobs has shape \(2, 6\)",
    ):
        compute_correction(a, b, torch.ones(2, 5))
    with pytest.raises(
        ValueError,
        match=r"trainer_logprobs has shape \(2, 5\) but response_mask has shape \(2, 6\)",
    ):
        mismatch_metrics(a, a, torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"but old_logprobs has shape \(2, 6\)"):
        compute_correction(a, a, torch.ones(2, 5), old_logprobs=b)
    with pytest.raises(ValueError, match=r"must be \[batch, tokens\], got shape \(5,\)"):
        compute_correction(torch.zeros(5), torch.zeros(5), torch.ones(5))


def test_nan_on_valid_token_names_count_and_position() -> None:
    train = torch.full((3, 4), -1.0)
    train[1, 2] = float("nan")
    train[2, 0] = float("-inf")
    mask = torch.ones(3, 4)
    with pytest.raises(
        ValueError,
        match=r"trainer_logprobs has 2 non-finite values .* first nan at \(batch 1, token 2\)",
    ):
        compute_correction(train, torch.full((3, 4), -1.0), mask)
    with pytest.raises(ValueError, match=r"rollout_logprobs has 2 non-finite"):
        mismatch_metrics(torch.full((3, 4), -1.0), train, mask)
    mask[1, 2] = mask[2, 0] = 0  # the same values on padding are fine
    assert math.isfinite(compute_correction(train, torch.full((3, 4), -1.0), mask).metrics["kl"])


def test_bad_mask_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"response_mask must be bool or 0/1; it has 1 other values, first 2.0 at \(batch 0, token 1\)",
    ):
        compute_correction(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[1.0, 2.0, 0.0]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cap": 0.0}, r"cap=0.0 is invalid"),
        ({"cap": -2.0}, r"cap=-2.0 is invalid"),
        ({"cap": 0.5}, r"cap=0.5 is invalid.*>= 1"),
        ({"cap": float("nan")}, r"cap=nan is invalid"),
        ({"weight": "token_mis", "band": (2.0, 0.5)}, r"band=\(2.0, 0.5\) is invalid.*lo < hi"),
        ({"weight": "token_mis", "band": (1.0, 1.0)}, r"lo < hi"),
        ({"weight": "seq_mis", "band": (1.2, 3.0)}, r"lo <= 1 <= hi"),
        ({"weight": "token_mis", "band": (0.5,)}, r"a pair \(lo, hi\)"),
        (
            {"weight": "token_tis", "band": (0.5, 2.0)},
            r"band=\(0.5, 2.0\) is invalid.*None unless weight",
        ),
        ({"weight": "tis"}, r"weight='tis' is invalid; allowed: \('none', 'token_tis'"),
        ({"mode": "on_policy"}, r"mode='on_policy' is invalid; allowed: \('decoupled', 'bypass'\)"),
        ({"log_ratio_clamp": 0}, r"log_ratio_clamp=0 is invalid"),
        ({"batch_normalize": "yes"}, r"batch_normalize='yes' is invalid"),
        ({"weight": "none", "batch_normalize": True}, r"no weights to normalize"),
        (
            {"mode": "bypass", "weight": "token_mis"},
            r"weight='token_mis' is invalid.*bypass mode.*rejection",
        ),
        ({"mode": "bypass", "batch_normalize": True}, r"batch_normalize=True is invalid.*bypass"),
        ({"rejection": ("token_k4",)}, r"'token_k4' is not one"),
        ({"rejection": ("seq_max_k1",)}, r"'seq_max_k1' is not one"),
        ({"rejection": ("token_k1", "token_k1")}, r"each option at most once"),
        ({"rejection": "token_k1"}, r"a tuple of option names"),
        ({"rejection": ("token_k2",)}, r"'token_k2' has no default"),
        (
            {"rejection": ("token_k1", "token_k2"), "rejection_thresholds": (2.0, 1.0, 3.0)},
            r"one threshold per option \(2\)",
        ),
        (
            {"rejection": ("token_k2",), "rejection_thresholds": ((0.5, 2.0),)},
            r"rejection_thresholds\[token_k2\].*single upper bound",
        ),
        (
            {"rejection": ("token_k3",), "rejection_thresholds": (0.0,)},
            r"rejection_thresholds\[token_k3\]=0.0 is invalid",
        ),
        (
            {"rejection": ("token_k1",), "rejection_thresholds": ((2.0, 0.5),)},
            r"rejection_thresholds\[token_k1\].*lo < hi",
        ),
        ({"rejection": ("seq_mean_k1",), "rejection_thresholds": (1.0,)}, r"lo < hi"),
        ({"rejection_thresholds": (0.1,)}, r"\(\) when rejection is empty"),
    ],
)
def test_invalid_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CorrectionConfig(**kwargs)


def test_old_logprobs_in_bypass_mode_is_an_error() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="old_logprobs was given in bypass mode"):
        compute_correction(x, x, torch.ones(1, 2), CorrectionConfig(mode="bypass"), old_logprobs=x)


def test_mismatch_metrics_rejects_bad_cap() -> None:
    with pytest.raises(ValueError, match=r"cap=0 is invalid"):
        mismatch_metrics(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=0)


# ---------------------------------------------------------------------------------------------------
# Config parsing


def test_from_string_and_from_dict() -> None:
    cfg = CorrectionConfig.from_string(
        "weight=token_mis band=0.5_5.0 rejection=seq_mean_k1,seq_mean_k3 rejection_thresholds=0.999_1.001,0.01 "
        "batch_normalize=true cap=3"
    )
    assert cfg == CorrectionConfig(
        weight="token_mis",
        band=(0.5, 5.0),
        rejection=("seq_mean_k1", "seq_mean_k3"),
        rejection_thresholds=((0.999, 1.001), 0.01),
        batch_normalize=True,
        cap=3.0,
    )
    yaml_like = {
        "mode": "bypass",
        "weight": "seq_tis",
        "rejection": ["token_k1"],
        "rejection_thresholds": [[0.5, 2.0]],
    }
    assert CorrectionConfig.from_dict(yaml_like) == CorrectionConfig(
        mode="bypass", weight="seq_tis", rejection=("token_k1",), rejection_thresholds=((0.5, 2.0),)
    )
    assert CorrectionConfig.from_dict({"rejection": None, "band": None}) == CorrectionConfig()
    assert hash(CorrectionConfig.from_dict(yaml_like))  # frozen and hashable after list -> tuple
    with pytest.raises(
        ValueError, match=r"unknown CorrectionConfig keys \['tis_cap'\]; allowed: \["
    ):
        CorrectionConfig.from_dict({"tis_cap": 2})
    with pytest.raises(ValueError, match=r"'cap' is not key=value"):
        CorrectionConfig.from_string("weight=token_tis cap")
    with pytest.raises(ValueError, match=r"cap='two' is not a number"):
        CorrectionConfig.from_string("cap=two")


# ---------------------------------------------------------------------------------------------------
# ppo_clip_loss


def ref_ppo_loss(
    lp, old, adv, mask, w, clip_low, clip_high, dual_clip, aggregation, denom=None, max_length=None
):
    B, T = len(mask), len(mask[0])
    per_seq: list[list[float]] = []
    for i in range(B):
        row = []
        for t in range(T):
            if not mask[i][t]:
                continue
            a = adv[i] if not isinstance(adv[i], list) else adv[i][t]
            r = math.exp(_clamp(lp[i][t] - old[i][t]))
            loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            if dual_clip is not None and a < 0:
                loss = min(loss, -dual_clip * a)
            row.append(loss * (w[i][t] if w is not None else 1.0))
        per_seq.append(row)
    seqs = [row for row in per_seq if row]
    if aggregation == "token_mean":
        total, count = sum(sum(row) for row in seqs), sum(len(row) for row in seqs)
    else:
        norm = {
            "seq_mean_token_mean": lambda row: sum(row) / len(row),
            "seq_mean_token_sum": sum,
            "seq_mean_token_sum_norm": lambda row: sum(row) / (max_length or T),
        }[aggregation]
        total, count = sum(norm(row) for row in seqs), len(seqs)
    return total / (denom if denom is not None else max(count, 1))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dual_clip", [None, 1.5])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_ppo_clip_loss_matches_reference(
    aggregation: str, dual_clip, per_token_adv: bool, gen: torch.Generator
) -> None:
    _, old, mask = random_batch(gen, extreme=False)
    lp = (old + torch.randn(old.shape, generator=gen) * 0.4).requires_grad_(True)
    B, T = old.shape
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=gen) * 2
    w = torch.rand(B, T, generator=gen) * 2 * mask
    loss, stats = ppo_clip_loss(
        lp,
        old,
        adv,
        mask,
        w,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=dual_clip,
        aggregation=aggregation,
        max_length=16,
    )
    args = (
        lp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        w.tolist(),
        0.2,
        0.28,
        dual_clip,
        aggregation,
    )
    _close(loss.item(), ref_ppo_loss(*args, max_length=16), "loss", rel=1e-5, abs_=1e-6)
    assert stats["pg_clipfrac"] > 0 and (dual_clip is None or stats["pg_clipfrac_dual"] > 0)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
    denom_loss, _ = ppo_clip_loss(
        lp,
        old,
        adv,
        mask,
        w,
        dual_clip=dual_clip,
        aggregation=aggregation,
        loss_scale_denominator=40.0,
        max_length=16,
    )
    _close(
        denom_loss.item(),
        ref_ppo_loss(*args, denom=40.0, max_length=16),
        "denominator",
        rel=1e-5,
        abs_=1e-6,
    )


def test_ppo_clip_loss_stats_hand_computed() -> None:
    """Four tokens (r, A): (1.5, +1) clipped high; (0.5, -1) clipped low; (4.0, -1) has l = 4 > c = 3, so
    the dual clip caps it at 3; (1.0, +1) is not clipped. A fifth, padded token holds NaN."""
    ratio = torch.tensor([[1.5, 0.5, 4.0, 1.0, 9.0]])
    old = torch.full_like(ratio, -2.0)
    lp = old + ratio.log()
    lp[0, 4] = float("nan")
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0)
    # per-token losses: -1.28 (clipped at 1.28), 0.8 (clipped at 0.8), 3.0 (dual clip), -1.0
    _close(loss.item(), (-1.28 + 0.8 + 3.0 - 1.0) / 4, "loss", rel=1e-6)
    assert (
        stats["pg_clipfrac"] == 0.5
        and stats["pg_clipfrac_high"] == 0.25
        and stats["pg_clipfrac_low"] == 0.25
    )
    assert stats["pg_clipfrac_dual"] == 0.25 and stats["is_weight_mean"] == 1.0
    _close(stats["ratio_mean"], (1.5 + 0.5 + 4.0 + 1.0) / 4, "ratio_mean", rel=1e-6)
    _close(stats["ratio_max"], 4.0, "ratio_max", rel=1e-6)
    _close(stats["ratio_min"], 0.5, "ratio_min", rel=1e-6)
    _close(stats["ppo_kl"], -sum(math.log(r) for r in (1.5, 0.5, 4.0, 1.0)) / 4, "ppo_kl", rel=1e-6)
    _close(stats["pg_loss"], loss.item(), "pg_loss", rel=0)


def test_ppo_clip_loss_weight_scales_gradient_and_ignores_padding_nan(gen: torch.Generator) -> None:
    _, old, mask = random_batch(gen, extreme=False)
    lp = old.detach().clone() + 0.01 * torch.randn(old.shape, generator=gen)
    lp[~mask] = float("nan")
    adv = torch.randn(old.shape[0], generator=gen)
    w = (torch.rand(old.shape, generator=gen) + 0.5) * mask
    grads = []
    for weights in (None, w):
        x = lp.clone().requires_grad_(True)
        loss, _ = ppo_clip_loss(x, old, adv, mask, weights)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0] * w)
    # weights are multipliers, never differentiated (verl #4105)
    live = w.clone().requires_grad_(True)
    x = lp.clone().requires_grad_(True)
    ppo_clip_loss(x, old, adv, mask, live)[0].backward()
    assert live.grad is None


def test_ppo_clip_loss_bad_input() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"advantages has shape \(3,\) \(expected \[B\] or \[B, T\]\)"
    ):
        ppo_clip_loss(x, x, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(
        ValueError, match=r"logprobs has shape \(2, 3\) but is_weights has shape \(2, 4\)"
    ):
        ppo_clip_loss(x, x, torch.zeros(2), torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"aggregation='mean' is invalid; allowed: \('token_mean'"):
        ppo_clip_loss(x, x, torch.zeros(2), torch.ones(2, 3), aggregation="mean")
    with pytest.raises(ValueError, match=r"dual_clip=1.0 is invalid"):
        ppo_clip_loss(x, x, torch.zeros(2), torch.ones(2, 3), dual_clip=1.0)
    bad_adv = torch.tensor([0.0, float("nan")])
    with pytest.raises(
        ValueError, match=r"advantages has 3 non-finite values .* \(batch 1, token 0\)"
    ):
        ppo_clip_loss(x, x, bad_adv, torch.ones(2, 3))


def test_end_to_end_with_correction(gen: torch.Generator) -> None:
    """The trainer's call sequence: correction once per batch, then the loss per micro-batch."""
    train, roll, mask = random_batch(gen, extreme=False)
    old = train.nan_to_num(0.0)
    corr = compute_correction(old, roll, mask, make_config(rejection=("token_k1",)))
    lp = old.clone().requires_grad_(True)
    adv = torch.randn(old.shape[0], generator=gen)
    loss, stats = ppo_clip_loss(lp, old, adv, corr.mask, corr.weights)
    expected = ref_ppo_loss(
        lp.tolist(),
        old.tolist(),
        adv.tolist(),
        corr.mask.tolist(),
        corr.weights.tolist(),
        0.2,
        0.28,
        None,
        "token_mean",
    )
    _close(loss.item(), expected, "loss", rel=1e-5, abs_=1e-6)
    _close(
        stats["is_weight_mean"], corr.weights[corr.mask].mean().item(), "is_weight_mean", rel=1e-6
    )
