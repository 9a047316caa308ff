"""A metric, rejection rule or loss aggregation that shares its name with verl computes verl's
quantity (issue 17). Expected values come from hand computation and from ``verl_reference``, an
independent float64 implementation of verl's formulas (verl-project/verl 1dda039, functions cited
there). Each batch is chosen so that the definitions the issue lists differ on it."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import verl_reference as verl
from flashrl.correction import CorrectionConfig, compute_correction, mismatch_metrics
from flashrl.rl.loss import AGGREGATIONS, ppo_clip_loss

E20 = math.exp(20.0)


def close(actual: float, expected: float, key: str, rel: float = 1e-5, abs_: float = 1e-6) -> None:
    assert math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_), (
        f"{key}: got {actual!r}, expected {expected!r}"
    )


def batch(deltas: list[list[float]], width: int | None = None, roll: float = -1.0):
    """Rows of per-token log-ratios (ragged; [] is an empty response), right-padded with NaN."""
    T = width or max(1, max(len(d) for d in deltas))
    mask = torch.tensor([[t < len(d) for t in range(T)] for d in deltas])
    lp_roll = torch.full((len(deltas), T), roll)
    delta = torch.tensor([d + [0.0] * (T - len(d)) for d in deltas])
    lp_train = (lp_roll + delta).masked_fill(~mask, float("nan"))
    return lp_train, lp_roll, mask


def lists(train: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor):
    """float64 lists for the reference (padding replaced by 0; the reference never reads it)."""
    return train.double().nan_to_num(0.0).tolist(), roll.double().tolist(), mask.tolist()


# -------------------------------------------------------------------------------------------------
# Item 1: rollout_is_max/min (sequence level: the product ratio before truncation; token level: the
# applied weights, as in verl's compute_is_metrics) -- and items 2, 3, 5 on the same batch

SEQ_DELTAS = [[10.0, 15.0], [-1.0, -2.0], [], [0.5]]  # S = 25, -3, (empty), 0.5


def test_sequence_is_max_min_are_untruncated() -> None:
    train, roll, mask = batch(SEQ_DELTAS)
    m = compute_correction(train, roll, mask, CorrectionConfig(weight="seq_tis", cap=2.0)).metrics
    close(m["rollout_is_max"], E20, "rollout_is_max")  # min(max S, 20): 4.85e8, not the cap 2
    close(m["rollout_is_min"], math.exp(-3.0), "rollout_is_min")
    # the mean is over tokens of the truncated weights
    close(m["rollout_is_mean"], (2 * 2 + 2 * math.exp(-3.0) + math.exp(0.5)) / 5, "rollout_is_mean")
    token = compute_correction(
        train, roll, mask, CorrectionConfig(weight="token_tis", cap=2.0)
    ).metrics
    assert token["rollout_is_max"] == 2.0  # token level: the applied (truncated) weights


def test_sequence_is_seq_stats_over_all_rows_with_unbiased_std() -> None:
    """Items 2 and 5: w_seq = (2, e^-3, 0 for the empty row, e^0.5), unbiased std over 4 rows."""
    train, roll, mask = batch(SEQ_DELTAS)
    m = compute_correction(train, roll, mask, CorrectionConfig(weight="seq_tis", cap=2.0)).metrics
    w_seq = [2.0, math.exp(-3.0), 0.0, math.exp(0.5)]
    close(m["rollout_is_seq_mean"], sum(w_seq) / 4, "seq_mean")
    close(m["rollout_is_seq_std"], statistics.stdev(w_seq), "seq_std")
    assert statistics.stdev(w_seq) > statistics.pstdev(w_seq) * 1.1  # the batch tells them apart
    close(m["rollout_is_seq_min"], 0.0, "seq_min")
    close(m["rollout_is_seq_max_deviation"], 1.0, "seq_max_deviation")  # the empty row: |0 - 1|
    # raw per-row means: e^20, e^-3, 0, e^0.5 against (1/2, 2): high 1 row, low 2 rows (empty incl.)
    close(m["rollout_is_seq_fraction_high"], 1 / 4, "seq_fraction_high")
    close(m["rollout_is_seq_fraction_low"], 2 / 4, "seq_fraction_low")


def test_sequence_ratio_fractions_count_sequences() -> None:
    """Item 3: with sequence IS the fractions count rows (S = 25 > log 2; S = -3 < log 1/2) over all
    4 rows, not tokens (which would give 2/5 each)."""
    train, roll, mask = batch(SEQ_DELTAS)
    m = compute_correction(train, roll, mask, CorrectionConfig(weight="seq_tis", cap=2.0)).metrics
    assert m["rollout_is_ratio_fraction_high"] == 0.25
    assert m["rollout_is_ratio_fraction_low"] == 0.25
    token = compute_correction(
        train, roll, mask, CorrectionConfig(weight="token_tis", cap=2.0)
    ).metrics
    close(token["rollout_is_ratio_fraction_high"], 0.4, "token high")
    close(token["rollout_is_ratio_fraction_low"], 0.4, "token low")


# -------------------------------------------------------------------------------------------------
# Item 4: rollout_rs_<seq option>_mean is token-weighted; the plain mean is _seq_mean


def test_rejection_seq_option_mean_is_token_weighted() -> None:
    """seq_sum_k2 (k2 = delta^2 / 2): row 0 has one token with delta 1 (sum 0.5), row 1 three with
    delta 0.2 (sum 0.06). Token-weighted: (0.5 + 3 * 0.06) / 4 = 0.17; over sequences: 0.28."""
    train, roll, mask = batch([[1.0], [0.2, 0.2, 0.2]])
    cfg = CorrectionConfig(rejection=("seq_sum_k2",), rejection_thresholds=(10.0,))
    m = compute_correction(train, roll, mask, cfg).metrics
    close(m["rollout_rs_seq_sum_k2_mean"], 0.17, "mean", rel=1e-5)
    close(m["rollout_rs_seq_sum_k2_seq_mean"], 0.28, "seq_mean", rel=1e-5)


# -------------------------------------------------------------------------------------------------
# Item 5: empty responses count as rows (log-ppl 0, ppl 1, weight 0)


def test_empty_rows_count_in_sequence_means() -> None:
    """lp_roll = -4. Row 0: delta = (-0.5, -0.5); rows 1 and 2 are empty; row 3: one token with
    delta = 3 (rho = e^3, rejected by token_k1 with its default band (1/2, 2))."""
    train, roll, mask = batch([[-0.5, -0.5], [], [], [3.0]], roll=-4.0)
    cfg = CorrectionConfig(rejection=("token_k1",))
    m = compute_correction(train, roll, mask, cfg).metrics
    close(m["training_ppl"], (math.exp(4.5) + 1 + 1 + math.exp(1.0)) / 4, "training_ppl")
    close(m["training_log_ppl"], (4.5 + 0 + 0 + 1.0) / 4, "training_log_ppl")
    close(m["rollout_ppl"], (math.exp(4.0) + 1 + 1 + math.exp(4.0)) / 4, "rollout_ppl")
    close(m["log_ppl_diff"], (0.5 + 0 + 0 - 3.0) / 4, "log_ppl_diff")
    close(m["log_ppl_diff_max"], 0.5, "log_ppl_diff_max")
    close(m["ppl_ratio"], (math.exp(0.5) + 1 + 1 + math.exp(-3.0)) / 4, "ppl_ratio")
    close(m["chi2_seq"], (math.exp(-2.0) + 1 + 1 + math.exp(6.0)) / 4 - 1, "chi2_seq")
    # one of four rows has a rejected token; per option the denominator is the 2 non-empty rows
    assert m["rollout_rs_seq_masked_fraction"] == 0.25
    assert m["rollout_rs_token_k1_seq_masked_fraction"] == 0.5


# -------------------------------------------------------------------------------------------------
# Item 6: k1 bands bound exp(k1) = pi_roll / pi_train (verl); *_rho options bound rho itself


def test_asymmetric_k1_band_follows_verl_and_rho_option_bounds_rho() -> None:
    """Band (0.8, 1.5): verl keeps log 0.8 <= -log rho <= log 1.5, i.e. 1/1.5 <= rho <= 1/0.8."""
    rho = [0.7, 0.9, 1.3, 1.6]
    train, roll, mask = batch([[math.log(r) for r in rho]])
    k1 = compute_correction(
        train,
        roll,
        mask,
        CorrectionConfig(rejection=("token_k1",), rejection_thresholds=((0.8, 1.5),)),
    )
    assert k1.mask.tolist() == [[True, True, False, False]]
    expected, _ = verl.rejection(*lists(train, roll, mask), ["token_k1"], ["0.8_1.5"])
    assert k1.mask.tolist() == expected
    on_rho = compute_correction(
        train,
        roll,
        mask,
        CorrectionConfig(rejection=("token_rho",), rejection_thresholds=((0.8, 1.5),)),
    )
    assert on_rho.mask.tolist() == [[False, True, True, False]]


def test_default_geo_rs_band_rejects_like_verl() -> None:
    """Mean log-ratio -0.001: -log G = 0.001 > log 1.001, so verl's 0.999_1.001 rejects the
    sequence; the same band on G (seq_mean_rho) keeps it (log 0.999 = -0.0010005)."""
    train, roll, mask = batch([[-0.001] * 8], roll=-1.0)
    geo = compute_correction(train, roll, mask, CorrectionConfig.geo_rs())
    assert not geo.mask.any()
    expected, _ = verl.rejection(*lists(train, roll, mask), ["seq_mean_k1"], ["0.999_1.001"])
    assert geo.mask.tolist() == expected
    rho = CorrectionConfig(rejection=("seq_mean_rho",))  # default (0.999, 1.001) on G
    assert compute_correction(train, roll, mask, rho).mask.all()


# -------------------------------------------------------------------------------------------------
# Item 7: loss aggregations against verl's agg_loss


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_aggregation_matches_verl_agg_loss(aggregation: str) -> None:
    """Ratio 1 (lp = old), so the per-token loss is -A * w; ragged rows and an empty one. verl's
    seq-mean-token-sum-norm is sum_i(token sum_i) / #non-empty rows / L since verl PR #5417."""
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 0, 5, 1, 2]
    T, L = 6, 8
    mask = torch.tensor([[t < n for t in range(T)] for n in lengths])
    old = -torch.rand(len(lengths), T, generator=gen)
    adv = torch.randn(len(lengths), T, generator=gen)
    w = torch.rand(len(lengths), T, generator=gen) * 2
    loss, _ = ppo_clip_loss(old.clone(), old, adv, mask, w, aggregation=aggregation, max_length=L)
    loss_mat = (-adv * w).double().tolist()
    expected = verl.agg_loss(
        loss_mat, mask.tolist(), aggregation.replace("_", "-"), loss_scale_factor=L
    )
    close(loss.item(), expected, aggregation)
    if aggregation == "seq_mean_token_sum_norm":  # not verl's pre-#5417 sum / L
        assert not math.isclose(loss.item(), expected * 4, rel_tol=1e-3)


# -------------------------------------------------------------------------------------------------
# Item 8: ratio fractions on the +-20-clamped ratio


def test_huge_cap_counts_no_clamped_token() -> None:
    """Cap 1e9 > e^20: a log-ratio of +25 becomes e^20 < C, so nothing exceeds the cap (verl)."""
    train, roll, mask = batch([[25.0, 0.1, -0.2]], roll=-30.0)
    m = compute_correction(train, roll, mask, CorrectionConfig(cap=1e9)).metrics
    assert m["rollout_is_ratio_fraction_high"] == 0.0
    assert mismatch_metrics(train, roll, mask, cap=1e9)["rollout_is_ratio_fraction_high"] == 0.0
    close(
        mismatch_metrics(train, roll, mask, cap=2.0)["rollout_is_ratio_fraction_high"], 1 / 3, "C=2"
    )


# -------------------------------------------------------------------------------------------------
# Found while comparing: std/ESS clamp at 0 (not 1/C); *_mis metrics use the band; probs-diff std


def test_is_std_and_ess_clamp_weights_at_zero() -> None:
    """Token TIS weights (0.1, 1): verl clamps to [0, C] for std and ESS (formerly [1/C, C])."""
    train, roll, mask = batch([[math.log(0.1), 0.0]])
    m = compute_correction(train, roll, mask, CorrectionConfig(cap=2.0)).metrics
    close(m["rollout_is_std"], 0.45, "std")  # population std of (0.1, 1)
    close(m["rollout_is_eff_sample_size"], 1.1**2 / (2 * (0.01 + 1)), "ess")


def test_mis_metrics_use_the_band() -> None:
    """IcePop band (0.5, 5), cap 2: rho = 3 is inside the band, so nothing counts as high."""
    train, roll, mask = batch([[math.log(3.0), 0.0, math.log(0.4)]])
    m = compute_correction(train, roll, mask, CorrectionConfig(weight="token_mis", cap=2.0)).metrics
    assert m["rollout_is_ratio_fraction_high"] == 0.0
    close(m["rollout_is_ratio_fraction_low"], 1 / 3, "low")  # 0.4 < 0.5
    close(m["rollout_is_oob_ratio"], 1 / 3, "oob")


def test_probs_diff_std_is_unbiased() -> None:
    train, roll, mask = batch([[math.log(2.0), 0.0, 0.0]], roll=math.log(0.25))
    diffs = [0.25, 0.0, 0.0]
    m = mismatch_metrics(train, roll, mask)
    close(m["rollout_probs_diff_std"], statistics.stdev(diffs), "std")


def test_ppo_kl_uses_the_clamped_log_ratio() -> None:
    """verl compute_policy_loss_vanilla: ppo_kl = mean(-clamp(lp - old, -20, 20))."""
    old = torch.tensor([[-30.0, -1.0]])
    lp = torch.tensor([[-5.0, -1.5]])  # log-ratios +25 (clamped to 20) and -0.5
    _, stats = ppo_clip_loss(lp, old, torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    close(stats["ppo_kl"], (-20.0 + 0.5) / 2, "ppo_kl")


# -------------------------------------------------------------------------------------------------
# Every verl metric, on random batches with ragged lengths, an empty row and extreme ratios


def random_batch(gen: torch.Generator, B: int = 9, T: int = 12):
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0], lengths[1] = 0, T
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    roll = -torch.rand(B, T, generator=gen) * 4
    delta = torch.randn(B, T, generator=gen) * 0.5
    delta[2, 0], delta[-1, 0] = 30.0, -30.0  # beyond the +-20 clamp
    train = (roll + delta).masked_fill(~mask, float("nan"))
    return train, roll.masked_fill(~mask, -1.0), mask


VERL_CONFIGS = [  # (flashrl config, verl rollout_is, rollout_is_threshold)
    (CorrectionConfig(weight="token_tis", cap=2.0), "token", 2.0),
    (CorrectionConfig(weight="token_tis", cap=1.3), "token", 1.3),
    (CorrectionConfig(weight="seq_tis", cap=5.0), "sequence", 5.0),
    (CorrectionConfig(weight="token_mis", band=(0.7, 1.4)), "token", "0.7_1.4"),
    (CorrectionConfig(weight="seq_mis", band=(0.3, 3.0)), "sequence", "0.3_3.0"),
    (CorrectionConfig(weight="none"), None, None),
]

VERL_REJECTION = [  # (options, thresholds as flashrl values, as verl strings)
    (("token_k1",), ((0.6, 1.6),), ["0.6_1.6"]),
    (("seq_sum_k1", "seq_mean_k3"), ((0.3, 4.0), 0.1), ["0.3_4.0", 0.1]),
    (("seq_mean_k1", "seq_max_k2", "token_k3"), ((0.8, 1.3), 1.0, 0.2), ["0.8_1.3", 1.0, 0.2]),
    (
        ("token_k2", "seq_sum_k2", "seq_mean_k2", "seq_max_k3", "seq_sum_k3"),
        (0.3, 1.5, 0.15, 0.8, 1.0),
        [0.3, 1.5, 0.15, 0.8, 1.0],
    ),
]


@pytest.mark.parametrize("rejection", VERL_REJECTION, ids=lambda r: "+".join(r[0]))
@pytest.mark.parametrize("weights", VERL_CONFIGS, ids=lambda c: f"{c[0].weight}-{c[2]}")
def test_every_verl_metric_mask_and_weight(weights, rejection, gen: torch.Generator) -> None:
    base, level, threshold = weights
    options, thresholds, verl_thresholds = rejection
    cfg = CorrectionConfig(
        weight=base.weight,
        cap=base.cap,
        band=base.band,
        rejection=options,
        rejection_thresholds=thresholds,
    )
    train, roll, mask = random_batch(gen)
    corr = compute_correction(train, roll, mask, cfg)
    args = lists(train, roll, mask)
    expected = verl.offpolicy(*args)
    keep, rs = verl.rejection(*args, list(options), verl_thresholds)
    expected.update(rs)
    assert corr.mask.tolist() == keep
    if level is not None:
        w, is_metrics = verl.is_weights(*args, level, threshold)
        expected.update(is_metrics)
        kept_w = torch.tensor(w, dtype=torch.float64) * torch.tensor(keep)
        torch.testing.assert_close(corr.weights.double(), kept_w, rtol=2e-6, atol=1e-7)
    missing = set(expected) - set(corr.metrics)
    assert not missing, f"verl metrics flashrl does not emit: {sorted(missing)}"
    for key, value in expected.items():
        close(corr.metrics[key], value, key, rel=1e-4, abs_=2e-5)


def test_standalone_mismatch_metrics_match_verl(gen: torch.Generator) -> None:
    train, roll, mask = random_batch(gen)
    m = mismatch_metrics(train, roll, mask, cap=1.5)
    args = lists(train, roll, mask)
    expected = {**verl.offpolicy(*args), **verl.probs_diff(*args)}
    _, token_is = verl.is_weights(*args, "token", 1.5)  # the token-level fractions of [1/C, C]
    for key in ("rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low"):
        expected[key] = token_is[key]
    for key, value in expected.items():
        close(m[key], value, key, rel=1e-4, abs_=2e-5)


@pytest.mark.parametrize("level", ["token", "seq_sum", "seq_mean"])
def test_rho_option_equals_k1_with_the_inverted_band(level: str, gen: torch.Generator) -> None:
    """(lo, hi) on rho is (1/hi, 1/lo) on exp(k1) = 1/rho: the same mask."""
    train, roll, mask = random_batch(gen)
    band = {"token": (0.7, 1.6), "seq_sum": (0.4, 3.0), "seq_mean": (0.9, 1.2)}[level]
    rho = CorrectionConfig(rejection=(f"{level}_rho",), rejection_thresholds=(band,))
    k1 = CorrectionConfig(
        rejection=(f"{level}_k1",), rejection_thresholds=((1 / band[1], 1 / band[0]),)
    )
    a, b = compute_correction(train, roll, mask, rho), compute_correction(train, roll, mask, k1)
    assert torch.equal(a.mask, b.mask) and 0 < a.metrics["rollout_rs_masked_fraction"] < 1


# -------------------------------------------------------------------------------------------------
# Batch normalization with rejection: verl normalizes over every valid token, before rejection
# (issue 24)

BN_THRESHOLDS = {  # option -> (flashrl threshold, verl spec); each rejects part of random_batch
    "token_k1": ((0.6, 1.6), "0.6_1.6"),
    "token_k2": (0.1, 0.1),
    "token_k3": (0.1, 0.1),
    "seq_sum_k1": ((0.3, 4.0), "0.3_4.0"),
    "seq_sum_k2": (1.0, 1.0),
    "seq_sum_k3": (1.0, 1.0),
    "seq_mean_k1": ((0.8, 1.3), "0.8_1.3"),
    "seq_mean_k2": (0.15, 0.15),
    "seq_mean_k3": (0.15, 0.15),
    "seq_max_k2": (0.8, 0.8),
    "seq_max_k3": (0.8, 0.8),
    "token_rho": ((0.6, 1.6), "0.6_1.6"),
    "seq_sum_rho": ((0.3, 4.0), "0.3_4.0"),
    "seq_mean_rho": ((0.8, 1.3), "0.8_1.3"),
}


def test_bn_thresholds_cover_every_rejection_option() -> None:
    from flashrl.correction.options import REJECTION_OPTIONS

    assert set(BN_THRESHOLDS) == set(REJECTION_OPTIONS)


@pytest.mark.parametrize("option", list(BN_THRESHOLDS))
@pytest.mark.parametrize("weights", VERL_CONFIGS[:-1], ids=lambda c: f"{c[0].weight}-{c[2]}")
def test_batch_normalization_before_rejection_matches_verl(
    weights, option: str, gen: torch.Generator
) -> None:
    base, level, threshold = weights
    flashrl_threshold, verl_threshold = BN_THRESHOLDS[option]
    cfg = CorrectionConfig(
        weight=base.weight,
        cap=base.cap,
        band=base.band,
        rejection=(option,),
        rejection_thresholds=(flashrl_threshold,),
        batch_normalize=True,
    )
    train, roll, mask = random_batch(gen)
    corr = compute_correction(train, roll, mask, cfg)
    args = lists(train, roll, mask)
    w, _ = verl.is_weights(*args, level, threshold)
    normalized, factor = verl.batch_normalize(w, args[2], level)
    keep, _ = verl.rejection(*args, [option], [verl_threshold])
    assert corr.mask.tolist() == keep
    assert 0 < corr.metrics["rollout_rs_masked_fraction"] < 1  # the batch rejects, not all
    expected = torch.tensor(normalized, dtype=torch.float64) * torch.tensor(keep)
    torch.testing.assert_close(corr.weights.double(), expected, rtol=1e-6, atol=0)
    close(corr.metrics["rollout_is_batch_norm_factor"], factor, "factor", rel=1e-6, abs_=0)


def test_batch_normalization_factor_is_over_valid_tokens_hand_computed() -> None:
    """rho = (2, 0.5 | 4), token TIS with C = 5, token_k1 band (1/3, 3) rejects the 4: verl divides
    by the mean over the three valid tokens, 6.5 / 3, not over the two kept ones (1.25)."""
    train, roll, mask = batch([[math.log(2.0), math.log(0.5)], [math.log(4.0)]])
    cfg = CorrectionConfig(
        cap=5.0, rejection=("token_k1",), rejection_thresholds=(3.0,), batch_normalize=True
    )
    corr = compute_correction(train, roll, mask, cfg)
    factor = 6.5 / 3
    close(corr.metrics["rollout_is_batch_norm_factor"], factor, "factor", rel=1e-6)
    expected = torch.tensor([[2.0 / factor, 0.5 / factor], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(corr.weights.double(), expected, rtol=1e-6, atol=0)
    assert corr.mask.tolist() == [[True, True], [False, False]]
