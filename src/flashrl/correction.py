"""Rollout correction: importance weights, rejection masks and mismatch metrics.

The rollout engine and the trainer assign different probabilities to the same sampled tokens, even
with identical BF16 weights (kernels, parallelism and reduction order differ), and quantized rollouts
widen the gap: "on-policy" RL is silently off-policy (Yao et al., "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", 2025; verl PR #2953). This module measures the gap and
corrects for it with importance sampling (IS) and rejection. Everything here is a pure function on
``[batch, tokens]`` fp32 tensors, without Python loops over tokens. The formulas follow verl
``verl/trainer/ppo/rollout_corr_helper.py`` and ``docs/algo/rollout_corr_math.md``, with TRL's
``vllm_importance_sampling_mode`` values (``token_truncate``, ``token_mask``, ``sequence_truncate``,
``sequence_mask``) as a checklist; the symbols are flashrl's (``shared/reference/correction.md``).

Notation
--------
For token ``t`` of sequence ``i``: ``m_t`` is the response mask (1 = trained token; never inferred
from a padding value), ``lp_roll`` the fp32 logprob the engine sampled with, ``lp_old`` the trainer's
no-grad recompute at the rollout weights and ``lp_cur`` the trainer at the current weights.

- ``mode="decoupled"`` (default): ``delta_t = lp_old - lp_roll``. The PPO ratio is taken against
  ``lp_old`` and the IS weight below multiplies the clipped per-token loss.
- ``mode="bypass"``: ``lp_old := lp_roll`` (no recompute), so ``delta_t = lp_cur - lp_roll`` and the
  PPO ratio ``exp(lp_cur - lp_roll)`` already divides by the rollout policy. Multiplying an IS weight
  into it would count the correction twice (slime PR #1912; verl forbids it), so in bypass mode
  ``Correction.weights`` carries only the rejection mask (1.0 on kept tokens) and the computed IS
  weights are returned separately in ``Correction.is_weights`` for metrics.

Padding is zeroed before anything is summed (``delta_t = 0`` where ``m_t = 0``), so NaN or garbage on
padding never reaches a result. Log-ratios are clamped to ``+-log_ratio_clamp`` (verl's
``SAFETY_BOUND = 20``) before ``exp``: token level clamps ``delta_t``, sequence level clamps the
sum ``S_i = sum_t m_t delta_t`` (not the terms). ``rho_t = exp(clamp(delta_t))``,
``rho_i = exp(clamp(S_i))``, ``n_i = sum_t m_t``, ``G_i = exp(S_i / n_i)``.

Weights (``CorrectionConfig.weight``); ``C = cap``, ``[lo, hi] = band`` stated on rho directly:

=============  ==================================================  ======================================
weight         w_t                                                 also known as
=============  ==================================================  ======================================
``none``       1                                                   no IS
``token_tis``  ``min(rho_t, C)``                                   TIS (Yao et al.); verl ``token``;
                                                                   TRL ``token_truncate``
``token_mis``  ``rho_t * 1[lo <= rho_t <= hi]``; the token stays   IcePop; TRL ``token_mask``
               in the loss denominators                            (default band 0.5-5.0)
``seq_tis``    ``min(rho_i, C)`` on every token of sequence i      verl ``sequence``; TRL
                                                                   ``sequence_truncate``
``seq_mis``    ``rho_i * 1[lo <= rho_i <= hi]``; default band      TRL ``sequence_mask``; "When Speed
               ``[0, C]``                                          Kills Stability"
=============  ==================================================  ======================================

Rejection (``CorrectionConfig.rejection``, verl ``rollout_rs`` option names) removes tokens from the
mask, so they also leave the loss denominators, unlike the ``*_mis`` weights (correction.md pitfalls 4
and 5). With ``l_t = clamp(delta_t)``: ``k1_t = -l_t``, ``k2_t = l_t^2 / 2``,
``k3_t = exp(l_t) - 1 - l_t`` (the means of k1 and k3 estimate KL(pi_roll || pi_train)). Levels:
``token_k*`` per token, ``seq_sum_k*`` / ``seq_mean_k*`` over a sequence's valid tokens,
``seq_max_k2/k3`` (any token too far drops the sequence, the old "veto"). A k1 option keeps a token or
sequence when ``lo <= exp(-k1) <= hi``, i.e. the bounds apply to rho (``seq_sum_k1``: the product
ratio, Seq-MIS; ``seq_mean_k1``: the geometric mean G, Geo-RS). verl applies the same numbers to
``1/rho`` (correction.md pitfall 2); here the bounds are on rho itself. k2 and k3 keep when the
statistic is ``<= hi``. Several options are AND-combined.

Order of operations (verl): log-ratio -> masked sum (sequence level) -> clamp -> exp -> truncate or
mask -> multiply by the mask -> detach -> rejection -> optional batch normalization
(``w <- w / mean(w)`` over kept tokens, or over the per-sequence weights of sequences with a kept
token for ``seq_*`` weights). Weights are always detached: in bypass mode rho depends on the current
parameters and a live weight would add a spurious ``log pi * grad w`` term (verl #4105).

Metrics
-------
``compute_correction`` returns a dict of floats; keys are stable for a given config (the caller adds
a prefix such as ``rollout_corr/`` when logging). ``lp_train`` is the numerator policy of the ratio
(``lp_old`` in decoupled mode, ``lp_cur`` in bypass mode), ``p = exp(lp)``. ``mean_m`` is the mean over
valid tokens, ``mean_seq`` / ``max_seq`` / ``min_seq`` run over sequences with at least one valid
token, ``mean_t`` over one sequence's valid tokens. Standard deviations are population ones. A
statistic over an empty set (no valid token or sequence) is 0.0, never NaN.

Mismatch (``mismatch_metrics``; also part of ``compute_correction``):

====================================  ============================================  ==================================
name                                  formula                                       meaning
====================================  ============================================  ==================================
kl                                    mean_m(lp_roll - lp_train)                    k1 estimate of KL(pi_roll ||
                                                                                    pi_train), can be negative; verl's
                                                                                    mismatch KL, FlashRL's vllm_kl
k3_kl                                 mean_m(exp(u) - 1 - u), u = lp_train -        k3 estimate of the same KL, >= 0
                                      lp_roll (unclamped)
chi2_token                            mean_m(rho_t^2) - 1                           token chi-square divergence
                                                                                    (variance of token weights)
chi2_seq                              mean_seq(rho_i^2) - 1                         sequence chi-square divergence
training_log_ppl, training_ppl        mean_seq(-mean_t lp_train),                   trainer (log-)perplexity of the
                                      mean_seq(exp(-mean_t lp_train))               responses
rollout_log_ppl, rollout_ppl          the same with lp_roll                         rollout (log-)perplexity
log_ppl_diff                          mean_seq(mean_t lp_roll - mean_t lp_train) =  log PPL_train - log PPL_roll; 0
                                      mean_seq(-log G_i)                            when matched
log_ppl_abs_diff                      mean_seq(abs(log G_i))                        the same without cancellation
log_ppl_diff_max, log_ppl_diff_min    max_seq(-log G_i), min_seq(-log G_i)          worst sequences (max-type
                                                                                    statistics warn earlier)
ppl_ratio                             mean_seq(1 / G_i)                             mean of PPL_train / PPL_roll; 1
                                                                                    when matched
rollout_probs_diff_max/mean/std       max, mean, std over valid tokens of           gap in probability space; the max
                                      abs(p_train - p_roll)                         reaches ~1.0 in practice
rollout_actor_probs_pearson_corr      Pearson correlation of p_train and p_roll     1 when matched (also for equal
                                      over valid tokens                             constant inputs)
token_mult_prob_error                 exp(mean_m abs(lp_train - lp_roll))           NeMo-RL; 1.0 perfect, < 1.03-1.05
                                                                                    acceptable
rollout_is_ratio_fraction_high/low    fraction of valid tokens with raw rho_t > C,  how often TIS would truncate (raw
                                      or < 1/C                                      ratios, pitfall 6)
====================================  ============================================  ==================================

IS weights (``compute_correction`` only). They describe the weights the config computes, before
rejection and batch normalization; in bypass mode these are ``Correction.is_weights``.
``w_bar = clamp(w, 1/C, C)``; ``w_i`` is the per-sequence weight ``mean_t w_t``; "raw" is the weight
before truncation or masking (``rho_t`` for token and ``none`` weights, ``rho_i`` for sequence ones).

====================================  ============================================  ==================================
name                                  formula                                       meaning
====================================  ============================================  ==================================
rollout_is_mean/max/min               mean, max, min of w over valid tokens         scale of the weights
rollout_is_std                        std of w_bar over valid tokens                spread, bounded so one outlier
                                                                                    cannot dominate
rollout_is_eff_sample_size            (sum_m w_bar)^2 / (n * sum_m w_bar^2), n =    ESS in (0, 1]; 1 when matched,
                                      #valid tokens                                 warn below 0.3
rollout_is_seq_mean/std/max/min       statistics of w_i over valid sequences        sequence-level weights
rollout_is_seq_max_deviation          max_seq abs(w_i - 1)                          worst sequence weight
rollout_is_seq_fraction_high/low      fraction of valid sequences with raw w_i >    on raw weights (pitfall 6)
                                      C, or < 1/C
rollout_is_clipped_fraction           fraction of valid tokens whose raw weight     tokens truncated by the cap
                                      exceeds C (*_tis weights; 0 otherwise)
rollout_is_oob_ratio                  fraction of valid tokens whose raw weight is  tokens zeroed by MIS (they stay in
                                      outside [lo, hi] (*_mis weights; 0            the denominators)
                                      otherwise)
rollout_is_batch_norm_factor          the mean divided out by batch_normalize; 1.0  1.0 means no rescaling
                                      when it is off
====================================  ============================================  ==================================

Rejection (``compute_correction`` only; per option ``<opt>`` in ``config.rejection``):

====================================  ============================================  ==================================
name                                  formula                                       meaning
====================================  ============================================  ==================================
rollout_rs_masked_fraction            fraction of valid tokens that rejection       tokens rejected
                                      removes from the mask
rollout_rs_seq_masked_fraction        fraction of valid sequences with a rejected   sequences touched by rejection
                                      token
rollout_rs_<opt>_masked_fraction      fraction of valid tokens that option <opt>    per-option token rate
                                      rejects
rollout_rs_<opt>_seq_masked_fraction  fraction of valid sequences in which <opt>    per-option sequence rate
                                      rejects a token
rollout_rs_<opt>_mean/max/min         statistics of the option's k1, k2 or k3       distance of the batch from the
                                      value at its level, over valid tokens         threshold
                                      (token_*) or valid sequences (seq_*)
====================================  ============================================  ==================================

Policy loss
-----------
``ppo_clip_loss`` applies the correction to a PPO-clip loss (DAPO clip-higher and dual clip,
``loss = agg(w_t * l_t)``) so that every trainer uses the same, tested wrapper (correction.md
pitfall 10). Pass ``Correction.mask`` as the mask and ``Correction.weights`` as ``is_weights``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NoReturn

import torch

from flashrl.errors import ConfigError, InputError

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_REJECTION_THRESHOLDS",
    "ICEPOP_BAND",
    "LOG_RATIO_CLAMP",
    "MODES",
    "REJECTION_OPTIONS",
    "WEIGHTS",
    "Correction",
    "CorrectionConfig",
    "compute_correction",
    "mismatch_metrics",
    "ppo_clip_loss",
]

MODES = ("decoupled", "bypass")
WEIGHTS = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis")
REJECTION_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

LOG_RATIO_CLAMP = 20.0
"""verl's ``SAFETY_BOUND``: weights stay in [e^-20, e^20] ~ [2.1e-9, 4.85e8]."""

ICEPOP_BAND = (0.5, 5.0)
"""Default ``band`` of ``token_mis`` (IcePop paper, OpenRLHF)."""

DEFAULT_REJECTION_THRESHOLDS: dict[str, float | tuple[float, float]] = {
    "seq_sum_k1": (0.5, 2.0),  # Seq-MIS, verl preset decoupled_seq_is_rs
    "seq_mean_k1": (0.999, 1.001),  # Geo-RS, verl presets: +-0.1% per-token geometric drift
    "seq_mean_k3": 0.01,  # verl K3 rejection
}
"""Thresholds used when ``rejection_thresholds`` is empty. ``token_k1`` defaults to ``(1/cap, cap)``;
the other options have no documented default and need explicit thresholds."""

Threshold = float | tuple[float, float]


def _fail(name: str, value: Any, allowed: str) -> NoReturn:
    raise ConfigError(f"CorrectionConfig.{name}={value!r} is invalid; allowed: {allowed}")


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _as_pair(name: str, value: Any) -> tuple[float, float]:
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_number(v) for v in value)):
        _fail(name, value, "a pair (lo, hi) of numbers")
    return float(value[0]), float(value[1])


def _check_band(name: str, band: tuple[float, float]) -> None:
    lo, hi = band
    if not (0.0 <= lo < hi):
        _fail(name, band, "0 <= lo < hi (bounds on rho = pi_train / pi_roll)")
    if not (lo <= 1.0 <= hi):
        _fail(name, band, "a band with lo <= 1 <= hi (one excluding rho = 1 would drop on-policy tokens)")


@dataclass(frozen=True)
class CorrectionConfig:
    """How to weight and reject tokens; validated on construction (see the module docstring).

    Attributes:
        mode: ``"decoupled"`` (ratio = pi_old / pi_roll) or ``"bypass"`` (ratio = pi_cur / pi_roll;
            IS weights are then computed for metrics only, never multiplied into a PPO-clip loss).
        weight: ``"none" | "token_tis" | "token_mis" | "seq_tis" | "seq_mis"``.
        cap: C for the ``*_tis`` weights, the upper bound of ``seq_mis`` when no band is given, and
            the diagnostic band ``[1/C, C]`` of the ``rollout_is_*`` metrics. Must be >= 1.
        band: ``(lo, hi)`` on rho for ``token_mis`` / ``seq_mis``; None means ``ICEPOP_BAND`` for
            ``token_mis`` and ``(0, cap)`` for ``seq_mis``. Other weights reject a band.
        rejection: verl ``rollout_rs`` option names (``REJECTION_OPTIONS``), AND-combined.
        rejection_thresholds: one entry per option, or one entry broadcast to all, or empty for the
            defaults (``DEFAULT_REJECTION_THRESHOLDS``, and ``(1/cap, cap)`` for ``token_k1``). A k1
            option takes ``(lo, hi)`` on rho, or a bare ``hi`` meaning ``(1/hi, hi)``; k2 and k3
            options take an upper bound.
        batch_normalize: divide the weights by their mean over kept tokens (decoupled mode only).
        log_ratio_clamp: log-ratios are clamped to +-this before ``exp``.
    """

    mode: str = "decoupled"
    weight: str = "token_tis"
    cap: float = 2.0
    band: tuple[float, float] | None = None
    rejection: tuple[str, ...] = ()
    rejection_thresholds: tuple[Threshold, ...] = ()
    batch_normalize: bool = False
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            _fail("mode", self.mode, str(MODES))
        if self.weight not in WEIGHTS:
            _fail("weight", self.weight, str(WEIGHTS))
        if not (_is_number(self.cap) and 1.0 <= self.cap < math.inf):
            _fail("cap", self.cap, "a finite number >= 1 (it truncates rho from above; typical 1.5-5)")
        if not (_is_number(self.log_ratio_clamp) and 0.0 < self.log_ratio_clamp <= 80.0):
            _fail("log_ratio_clamp", self.log_ratio_clamp, "a number in (0, 80] (exp must stay finite in fp32)")
        if not isinstance(self.batch_normalize, bool):
            _fail("batch_normalize", self.batch_normalize, "True or False")
        if self.band is not None:
            band = _as_pair("band", self.band)
            _check_band("band", band)
            object.__setattr__(self, "band", band)
            if self.weight not in ("token_mis", "seq_mis"):
                _fail("band", self.band, f"None unless weight is 'token_mis' or 'seq_mis' (weight={self.weight!r})")
        object.__setattr__(self, "cap", float(self.cap))
        object.__setattr__(self, "log_ratio_clamp", float(self.log_ratio_clamp))
        self._check_rejection()
        if self.batch_normalize and self.weight == "none":
            _fail("batch_normalize", True, "False when weight='none' (there are no weights to normalize)")
        if self.mode == "bypass":
            # In bypass mode the PPO ratio already divides by pi_roll, so Correction.weights carries only
            # the rejection mask: a masking weight or a normalization would silently do nothing.
            if self.weight in ("token_mis", "seq_mis"):
                _fail(
                    "weight",
                    self.weight,
                    "'none', 'token_tis' or 'seq_tis' in bypass mode (IS weights are "
                    "metrics-only there); to drop tokens or sequences use rejection=('token_k1',) or "
                    "('seq_sum_k1',) with the same band",
                )
            if self.batch_normalize:
                _fail("batch_normalize", True, "False in bypass mode (IS weights are not applied to the loss)")

    def _check_rejection(self) -> None:
        options = tuple(self.rejection) if isinstance(self.rejection, (tuple, list)) else None
        if options is None:
            _fail("rejection", self.rejection, f"a tuple of option names from {REJECTION_OPTIONS}")
        for option in options:
            if option not in REJECTION_OPTIONS:
                _fail("rejection", self.rejection, f"option names from {REJECTION_OPTIONS}; {option!r} is not one")
        if len(set(options)) != len(options):
            _fail("rejection", self.rejection, "each option at most once")
        thresholds = self.rejection_thresholds
        if not isinstance(thresholds, (tuple, list)):
            _fail("rejection_thresholds", thresholds, "a tuple of numbers or (lo, hi) pairs")
        thresholds = tuple(tuple(t) if isinstance(t, list) else t for t in thresholds)
        if thresholds and not options:
            _fail("rejection_thresholds", thresholds, "() when rejection is empty")
        if len(thresholds) not in (0, 1, len(options)):
            _fail(
                "rejection_thresholds",
                thresholds,
                f"one threshold per option ({len(options)}), one shared threshold, or () for the defaults",
            )
        object.__setattr__(self, "rejection", options)
        object.__setattr__(self, "rejection_thresholds", thresholds)
        self.rejection_bounds()  # validates every threshold

    def rejection_bounds(self) -> dict[str, tuple[float, float]]:
        """Resolved threshold per rejection option: ``(lo, hi)`` on rho for k1 options, ``(0, hi)``
        on the statistic for k2/k3 options."""
        thresholds = self.rejection_thresholds
        if len(thresholds) == 1:
            thresholds = thresholds * len(self.rejection)
        bounds = {}
        for i, option in enumerate(self.rejection):
            if thresholds:
                spec = thresholds[i]
            elif option == "token_k1":
                spec = (1.0 / self.cap, self.cap)
            elif option in DEFAULT_REJECTION_THRESHOLDS:
                spec = DEFAULT_REJECTION_THRESHOLDS[option]
            else:
                _fail(
                    "rejection_thresholds",
                    (),
                    f"explicit thresholds: {option!r} has no default "
                    f"(defaults exist for token_k1, {', '.join(DEFAULT_REJECTION_THRESHOLDS)})",
                )
            name = f"rejection_thresholds[{option}]"
            if option.endswith("k1"):
                if _is_number(spec):
                    spec = (1.0 / spec, float(spec)) if spec > 0 else (float(spec), float(spec))
                bounds[option] = _as_pair(name, spec)
                _check_band(name, bounds[option])
            else:
                if not (_is_number(spec) and spec > 0):
                    _fail(name, spec, f"a single upper bound > 0 for the {option[-2:]} statistic (no (lo, hi) pair)")
                bounds[option] = (0.0, float(spec))
        return bounds

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CorrectionConfig:
        """Build from a mapping such as a YAML section. Lists become tuples; ``band``, ``rejection`` and
        ``rejection_thresholds`` also accept verl-style strings (``"0.5_5.0"``, ``"seq_mean_k1,seq_mean_k3"``,
        ``"0.999_1.001,0.01"``); scalars may be strings."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown CorrectionConfig keys {unknown}; allowed: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key in ("cap", "log_ratio_clamp") and isinstance(value, str):
                value = _parse_float(key, value)
            elif key == "batch_normalize" and isinstance(value, str):
                value = _parse_bool(key, value)
            elif key == "band":
                value = None if value in (None, "", "none") else _parse_threshold(key, value)
            elif key == "rejection":
                items = value.split(",") if isinstance(value, str) else (value or ())
                value = tuple(s.strip() for s in items if s.strip() and s.strip() != "none")
            elif key == "rejection_thresholds":
                items = value.split(",") if isinstance(value, str) else (value or ())
                value = tuple(_parse_threshold(key, v) for v in items if not (isinstance(v, str) and not v.strip()))
            kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_string(cls, spec: str) -> CorrectionConfig:
        """Build from whitespace-separated ``key=value`` pairs (for a CLI flag), for example
        ``"weight=token_mis band=0.5_5.0 rejection=seq_mean_k1,seq_mean_k3 rejection_thresholds=0.999_1.001,0.01"``.
        """
        values = {}
        for item in spec.split():
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"correction spec item {item!r} is not key=value (in {spec!r})")
            values[key] = value
        return cls.from_dict(values)


def _parse_float(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"CorrectionConfig.{key}={text!r} is not a number") from None


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"CorrectionConfig.{key}={text!r} is invalid; allowed: true/false, 1/0, yes/no")
    return lowered in ("true", "1", "yes")


def _parse_threshold(key: str, value: Any) -> Threshold:
    if isinstance(value, str):
        parts = value.strip().split("_")
        if len(parts) == 2:
            return (_parse_float(key, parts[0]), _parse_float(key, parts[1]))
        return _parse_float(key, value)
    if isinstance(value, list):
        return tuple(value)
    return value


@dataclass
class Correction:
    """Result of ``compute_correction``.

    Attributes:
        weights: ``[B, T]`` fp32, detached: what to multiply into the per-token policy loss. 0 on
            padding and rejected tokens. In decoupled mode these are the IS weights; in bypass mode
            they are 1.0 on kept tokens (the PPO ratio already corrects for the rollout policy).
        mask: ``[B, T]`` response mask with rejected tokens removed, in the input mask's dtype; use it
            for the loss denominators (``*_mis`` zeroed tokens stay in it, rejected ones do not).
        metrics: see the module docstring.
        is_weights: ``[B, T]`` fp32, detached: the IS weights the config computes, 0 on padding and
            rejected tokens. The same tensor as ``weights`` in decoupled mode; in bypass mode they are
            for metrics (or a REINFORCE-style loss, which unlike PPO-clip does apply them).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]
    is_weights: torch.Tensor


# ---------------------------------------------------------------------------------------------------
# Input checks


def _check_shapes(named: Mapping[str, torch.Tensor]) -> None:
    (first_name, first), *rest = named.items()
    if first.dim() != 2:
        raise InputError(f"{first_name} must be [batch, tokens], got shape {tuple(first.shape)}")
    for name, tensor in rest:
        if tensor.shape != first.shape:
            raise InputError(
                f"shape mismatch: {first_name} has shape {tuple(first.shape)} "
                f"but {name} has shape {tuple(tensor.shape)}"
            )


def _bool_mask(response_mask: torch.Tensor) -> torch.Tensor:
    if response_mask.dtype == torch.bool:
        return response_mask
    bad = (response_mask != 0) & (response_mask != 1)
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise InputError(
            f"response_mask must be bool or 0/1; it has {int(bad.sum())} other values, first "
            f"{response_mask[first].item()!r} at (batch {first[0]}, token {first[1]})"
        )
    return response_mask != 0


def _valid_float(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``tensor`` with 0 on padding; raises if a valid token holds NaN or inf."""
    if not tensor.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    clean = torch.where(mask, tensor.to(torch.float32), 0.0)
    # A NaN or inf on a valid token makes the sum non-finite: one reduction answers "all finite?", and the
    # element-wise scan runs only to report where (a finite sum overflowing to inf finds nothing and passes).
    if not torch.isfinite(clean.detach().sum()):
        bad = ~torch.isfinite(clean.detach())
        if bad.any():
            first = tuple(bad.nonzero()[0].tolist())
            raise InputError(
                f"{name} has {int(bad.sum())} non-finite values (NaN or inf) on valid tokens; first "
                f"{tensor[first].item()} at (batch {first[0]}, token {first[1]}). Padding is ignored; a NaN "
                "on a response token would make the loss NaN."
            )
    return clean


# ---------------------------------------------------------------------------------------------------
# Masked reductions


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of x where mask is True (any shape); 0 if there is none."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(mask.any(), torch.where(mask, x, -math.inf).amax(), 0.0)


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(mask.any(), torch.where(mask, x, math.inf).amin(), 0.0)


@dataclass
class _Valid:
    """The response mask with the counts that masked reductions divide by.

    Convention: the ``[B, T]`` tensors handed to ``mean`` and ``frac`` are 0 (or False) on padding,
    which this module keeps by zeroing the logprobs there first. A masked mean is then one plain
    ``sum()``: a single pass, PyTorch's cascade summation, and no mask-sized temporary (at 512 x 8192
    every temporary costs 16 MiB of fresh pages). ``masked_mean`` is for values that are not 0 there.
    """

    mask: torch.Tensor  # [B, T] bool
    maskf: torch.Tensor  # [B, T] fp32
    n: torch.Tensor  # [B] valid tokens per sequence (fp32)
    seq: torch.Tensor  # [B] bool: the sequence has a valid token
    n_tokens: torch.Tensor  # scalar, clamped to >= 1 so that empty batches give 0, not NaN
    n_seqs: torch.Tensor  # scalar, clamped to >= 1

    @classmethod
    def of(cls, mask: torch.Tensor) -> _Valid:
        maskf = mask.to(torch.float32)
        n = maskf.sum(-1)
        seq = n > 0
        return cls(mask, maskf, n, seq, n.sum().clamp_min(1.0), seq.count_nonzero().float().clamp_min(1.0))

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() / self.n_tokens

    def masked_mean(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask, x, 0.0).sum() / self.n_tokens

    def frac(self, cond: torch.Tensor) -> torch.Tensor:
        return cond.count_nonzero() / self.n_tokens

    def std(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """Population standard deviation over valid tokens, given their mean (x may be anything on padding)."""
        return ((x - mean).mul_(self.maskf).square_().sum() / self.n_tokens).sqrt()

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return _masked_max(x, self.mask)

    def min(self, x: torch.Tensor) -> torch.Tensor:
        return _masked_min(x, self.mask)

    def seq_mean(self, values: torch.Tensor) -> torch.Tensor:
        return torch.where(self.seq, values, 0.0).sum() / self.n_seqs

    def seq_std(self, values: torch.Tensor) -> torch.Tensor:
        return self.seq_mean((values - self.seq_mean(values)).square()).sqrt()

    def seq_frac(self, cond: torch.Tensor) -> torch.Tensor:
        return (cond & self.seq).count_nonzero() / self.n_seqs

    def seq_max(self, values: torch.Tensor) -> torch.Tensor:
        return _masked_max(values, self.seq)

    def seq_min(self, values: torch.Tensor) -> torch.Tensor:
        return _masked_min(values, self.seq)


def _floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Tensor scalars -> Python floats in one transfer."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    stacked = torch.stack([metrics[k].to(torch.float32) for k in keys]).tolist() if keys else []
    values = dict(zip(keys, stacked, strict=True))
    return {k: values[k] if k in values else float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------------
# Log-ratios


@dataclass
class _LogRatio:
    """Everything derived from ``delta = lp_train - lp_roll`` that several steps share; token tensors
    are 0 on padding."""

    valid: _Valid
    delta: torch.Tensor  # [B, T] unclamped log-ratio
    ell: torch.Tensor  # [B, T] clamped log-ratio
    rho_m1: torch.Tensor  # [B, T] expm1(ell) = rho - 1 (keeps precision near rho = 1)
    seq_delta: torch.Tensor  # [B] S_i, the unclamped masked sum of delta
    seq_ell: torch.Tensor  # [B] clamp(S_i)

    @classmethod
    def build(cls, lp_train: torch.Tensor, lp_roll: torch.Tensor, valid: _Valid, bound: float) -> _LogRatio:
        delta = lp_train - lp_roll  # both are 0 on padding
        ell = delta.clamp(-bound, bound)
        seq_delta = delta.sum(-1)
        return cls(valid, delta, ell, torch.expm1(ell), seq_delta, seq_delta.clamp(-bound, bound))

    @functools.cached_property
    def k3(self) -> torch.Tensor:
        """``[B, T]`` ``rho - 1 - ell`` (k3 of the clamped log-ratio), shared by metrics and rejection."""
        return self.rho_m1 - self.ell

    def k3_sum_unclamped(self) -> torch.Tensor:
        """Sum of ``exp(delta) - 1 - delta`` over valid tokens, unclamped. ``expm1`` is several times
        slower than ``exp`` on CPU, so only the tokens the clamp changed (normally none) are redone."""
        total = self.k3.sum()
        clamped = self.delta != self.ell
        if clamped.any():
            d, e = self.delta[clamped], self.ell[clamped]
            total = total + (torch.expm1(d).sub_(d) - torch.expm1(e).sub_(e)).sum()
        return total


# ---------------------------------------------------------------------------------------------------
# Metrics


def _mismatch_metrics(
    lp_train: torch.Tensor, lp_roll: torch.Tensor, r: _LogRatio, cap: float
) -> dict[str, torch.Tensor | float]:
    v, delta = r.valid, r.delta
    n = v.n.clamp_min(1.0)
    neg_log_g = -r.seq_delta / n  # mean_t lp_roll - mean_t lp_train, per sequence
    train_log_ppl, roll_log_ppl = -lp_train.sum(-1) / n, -lp_roll.sum(-1) / n
    p_train, p_roll = lp_train.exp().mul_(v.maskf), lp_roll.exp().mul_(v.maskf)
    prob_diff = (p_train - p_roll).abs_()
    diff_mean = v.mean(prob_diff)
    diff_max = prob_diff.amax() if prob_diff.numel() else prob_diff.new_zeros(())  # >= 0, and 0 on padding
    pearson = _pearson(p_train, p_roll, v, equal=diff_max == 0)  # last use of p_train, p_roll: centers them
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


def _pearson(a: torch.Tensor, b: torch.Tensor, v: _Valid, equal: torch.Tensor) -> torch.Tensor:
    """Pearson correlation over valid tokens of a and b (both 0 on padding; centered in place)."""
    da = a.sub_(v.mean(a)).mul_(v.maskf).flatten()
    db = b.sub_(v.mean(b)).mul_(v.maskf).flatten()
    cov, denom = torch.dot(da, db), (torch.dot(da, da) * torch.dot(db, db)).sqrt()
    # Constant inputs have no correlation coefficient; report 1.0 when they also agree (no mismatch).
    return torch.where(denom > 0, cov / denom.clamp_min(1e-30), equal.float())


def _weight_metrics(
    weights: torch.Tensor, raw: torch.Tensor, affected: torch.Tensor, r: _LogRatio, config: CorrectionConfig
) -> dict[str, torch.Tensor | float]:
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


# ---------------------------------------------------------------------------------------------------
# Weights and rejection


def _resolved_band(config: CorrectionConfig) -> tuple[float, float]:
    if config.band is not None:
        return config.band
    return ICEPOP_BAND if config.weight == "token_mis" else (0.0, config.cap)


def _is_weights(r: _LogRatio, config: CorrectionConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, T]`` weights, raw weights (0 on padding; see the module docstring) and the valid tokens
    whose weight was truncated (``*_tis``) or zeroed (``*_mis``)."""
    v = r.valid
    if config.weight.startswith("seq"):
        raw = v.maskf * r.seq_ell.exp().unsqueeze(-1)
        log_ratio = r.seq_ell.unsqueeze(-1)  # [B, 1], broadcast
    else:
        raw = (r.rho_m1 + 1.0).mul_(v.maskf)
        log_ratio = r.ell
    if config.weight == "none":
        return v.maskf, raw, torch.zeros_like(v.mask)
    if config.weight.endswith("tis"):
        return raw.clamp(max=config.cap), raw, (log_ratio > math.log(config.cap)) & v.mask
    lo, hi = _resolved_band(config)  # *_mis: compare in log space, exact at the band edges
    inside = (log_ratio >= _log(lo)) & (log_ratio <= _log(hi))
    return torch.where(inside, raw, 0.0), raw, ~inside & v.mask


def _passes(stat: torch.Tensor, kind: str, lo: float, hi: float) -> torch.Tensor:
    if kind == "k1":  # bounds on rho = exp(-k1): lo <= exp(-k1) <= hi
        return (stat <= -_log(lo)) & (stat >= -_log(hi))
    return stat <= hi


def _rejection(r: _LogRatio, config: CorrectionConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The response mask with rejected tokens removed, and the rejection metrics."""
    v = r.valid
    if not config.rejection:
        return v.mask, {"rollout_rs_masked_fraction": 0.0, "rollout_rs_seq_masked_fraction": 0.0}
    token_stats = {  # the sign convention is verl's: k1 = -log rho
        "k1": lambda: -r.ell,
        "k2": lambda: 0.5 * r.ell.square(),
        "k3": lambda: r.k3,
    }
    kept, seq_kept = v.mask, torch.ones_like(v.seq)
    metrics: dict[str, torch.Tensor | float] = {}
    for option, (lo, hi) in config.rejection_bounds().items():
        level, kind = option.rsplit("_", 1)
        stat = token_stats[kind]()  # 0 on padding
        prefix = f"rollout_rs_{option}"
        if level == "token":
            rejected = ~_passes(stat, kind, lo, hi) & v.mask
            kept = kept & ~rejected
            metrics[f"{prefix}_masked_fraction"] = v.frac(rejected)
            metrics[f"{prefix}_seq_masked_fraction"] = v.seq_frac(rejected.any(-1))
            metrics.update({f"{prefix}_mean": v.mean(stat), f"{prefix}_max": v.max(stat), f"{prefix}_min": v.min(stat)})
            continue
        if level == "seq_sum":
            stat = stat.sum(-1)
        elif level == "seq_mean":
            stat = stat.sum(-1) / v.n.clamp_min(1.0)
        else:  # seq_max (k2, k3 only): they are >= 0 and 0 on padding, so a plain row max is the masked one
            stat = stat.amax(-1) if stat.shape[-1] else stat.new_zeros(stat.shape[:-1])
        failed = ~_passes(stat, kind, lo, hi) & v.seq
        seq_kept = seq_kept & ~failed
        metrics[f"{prefix}_masked_fraction"] = (v.n * failed).sum() / v.n_tokens
        metrics[f"{prefix}_seq_masked_fraction"] = v.seq_frac(failed)
        metrics.update(
            {f"{prefix}_mean": v.seq_mean(stat), f"{prefix}_max": v.seq_max(stat), f"{prefix}_min": v.seq_min(stat)}
        )
    kept = kept & seq_kept.unsqueeze(-1)
    kept_n = kept.count_nonzero(-1)
    summary = {
        "rollout_rs_masked_fraction": (v.n - kept_n).sum() / v.n_tokens,
        "rollout_rs_seq_masked_fraction": v.seq_frac(kept_n < v.n),
    }
    return kept, {**summary, **metrics}


def _batch_normalize(
    weights: torch.Tensor, kept: torch.Tensor, config: CorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """Divide by the mean weight over kept tokens (``seq_*`` weights: over kept sequences, each once)."""
    if config.weight.startswith("seq"):
        kept_seq = kept.any(-1)
        per_seq = weights.amax(-1) if weights.shape[-1] else weights.new_zeros(weights.shape[:-1])
        factor = torch.where(kept_seq, per_seq, 0.0).sum() / kept_seq.count_nonzero().clamp_min(1)
    else:
        factor = weights.sum() / kept.count_nonzero().clamp_min(1)  # weights are 0 off the kept tokens
    if factor.item() <= 1e-8:  # nothing (or only zero weights) kept: leave the weights alone
        return weights, 1.0
    return weights / factor, factor


# ---------------------------------------------------------------------------------------------------
# Public API


@torch.no_grad()
def compute_correction(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    config: CorrectionConfig = CorrectionConfig(),
    old_logprobs: torch.Tensor | None = None,
) -> Correction:
    """IS weights, rejection mask and metrics for one batch.

    Args:
        trainer_logprobs: ``[B, T]`` trainer logprobs of the sampled tokens. In bypass mode: the
            current policy (may require grad; the weights are detached regardless). In decoupled mode:
            the no-grad recompute at the rollout weights, unless ``old_logprobs`` is given.
        rollout_logprobs: ``[B, T]`` fp32 logprobs the engine sampled with (processed logprobs).
        response_mask: ``[B, T]`` bool or 0/1: 1 on trained response tokens. Padding may hold NaN.
        config: see ``CorrectionConfig``.
        old_logprobs: ``[B, T]`` pi_old recompute (decoupled mode). When given, it is the ratio's
            numerator and ``trainer_logprobs`` (e.g. the current policy) is only validated. Bypass mode
            has no separate old policy (pi_old := pi_roll) and raises if it is given.

    Returns:
        ``Correction`` (weights, mask, metrics, is_weights); see its docstring.

    Raises:
        ValueError: shape mismatch (naming both tensors and shapes), a mask value other than 0/1,
            NaN or inf on a valid token (with the count and first position), or ``old_logprobs`` in
            bypass mode.
    """
    named = {"trainer_logprobs": trainer_logprobs, "rollout_logprobs": rollout_logprobs, "response_mask": response_mask}
    if old_logprobs is not None:
        if config.mode == "bypass":
            raise InputError(
                "old_logprobs was given in bypass mode, where the ratio is pi_cur / pi_roll and pi_old := pi_roll; "
                "use mode='decoupled' to correct with an old-policy recompute"
            )
        named["old_logprobs"] = old_logprobs
    _check_shapes(named)
    mask = _bool_mask(response_mask)
    lp_train = _valid_float("trainer_logprobs", trainer_logprobs, mask)
    lp_roll = _valid_float("rollout_logprobs", rollout_logprobs, mask)
    if old_logprobs is not None:
        lp_train = _valid_float("old_logprobs", old_logprobs, mask)

    valid = _Valid.of(mask)
    r = _LogRatio.build(lp_train, lp_roll, valid, config.log_ratio_clamp)
    weights, raw, affected = _is_weights(r, config)
    metrics = _mismatch_metrics(lp_train, lp_roll, r, config.cap)
    metrics.update(_weight_metrics(weights, raw, affected, r, config))

    kept, rs_metrics = _rejection(r, config)
    if config.rejection:
        weights = torch.where(kept, weights, 0.0)
    factor: torch.Tensor | float = 1.0
    if config.batch_normalize:
        weights, factor = _batch_normalize(weights, kept, config)
    metrics["rollout_is_batch_norm_factor"] = factor
    metrics.update(rs_metrics)

    new_mask = kept if response_mask.dtype == torch.bool else kept.to(response_mask.dtype)
    loss_weights = weights if config.mode == "decoupled" else kept.to(torch.float32)
    return Correction(weights=loss_weights, mask=new_mask, metrics=_floats(metrics), is_weights=weights)


@torch.no_grad()
def mismatch_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, cap: float = 2.0
) -> dict[str, float]:
    """The mismatch metrics of the module docstring (``kl`` ... ``rollout_is_ratio_fraction_low``) for
    ``trainer_logprobs`` against ``rollout_logprobs``; ``cap`` sets the ``[1/cap, cap]`` fraction band."""
    if not (_is_number(cap) and cap >= 1.0):
        raise ConfigError(f"cap={cap!r} is invalid; allowed: a number >= 1")
    _check_shapes(
        {"trainer_logprobs": trainer_logprobs, "rollout_logprobs": rollout_logprobs, "response_mask": response_mask}
    )
    mask = _bool_mask(response_mask)
    lp_train = _valid_float("trainer_logprobs", trainer_logprobs, mask)
    lp_roll = _valid_float("rollout_logprobs", rollout_logprobs, mask)
    r = _LogRatio.build(lp_train, lp_roll, _Valid.of(mask), LOG_RATIO_CLAMP)
    return _floats(_mismatch_metrics(lp_train, lp_roll, r, float(cap)))


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

    Pass ``Correction.mask`` as ``response_mask`` and ``Correction.weights`` as ``is_weights``. In
    bypass mode (``old_logprobs`` = rollout logprobs) ``Correction.weights`` is the kept-token mask, so
    no IS weight multiplies a ratio that already divides by pi_roll (double counting, correction.md
    pitfall 7); do not pass ``Correction.is_weights`` here in that mode.

    Args:
        logprobs: ``[B, T]`` current-policy logprobs (with grad).
        old_logprobs: ``[B, T]`` logprobs the PPO ratio is taken against (detached here).
        advantages: ``[B]`` (one per sequence) or ``[B, T]``.
        response_mask: ``[B, T]`` bool or 0/1; padding may hold NaN in any input.
        is_weights: ``[B, T]`` per-token multipliers (detached here), or None for 1.
        clip_low, clip_high: epsilon of the clip range (DAPO clip-higher: 0.2, 0.28).
        dual_clip: c > 1 bounding the loss of negative-advantage tokens at ``-c * A`` (DAPO: 10), or None.
        aggregation: over kept tokens; sequence means skip sequences without kept tokens:
            ``token_mean``: ``sum(l) / #tokens``; ``seq_mean_token_mean``: mean over sequences of
            the per-sequence token mean; ``seq_mean_token_sum``: mean over sequences of the token sum;
            ``seq_mean_token_sum_norm`` (Dr.GRPO): mean over sequences of ``token_sum / max_length``.
        loss_scale_denominator: replaces the outer denominator (#tokens for ``token_mean``, #sequences
            otherwise), e.g. the count over the whole mini-batch when gradient accumulation splits it.
        max_length: the constant length of ``seq_mean_token_sum_norm``; defaults to ``T``. Pass the
            configured maximum response length so that differently padded micro-batches agree.
        log_ratio_clamp: ``logprobs - old_logprobs`` is clamped to +-this before ``exp``.

    Returns:
        ``(loss, stats)``: a scalar loss with grad, and floats over kept tokens: ``pg_loss``,
        ``pg_clipfrac`` (the clip was active), ``pg_clipfrac_high`` (``r > 1 + clip_high`` with
        ``A > 0``), ``pg_clipfrac_low`` (``r < 1 - clip_low`` with ``A < 0``), ``pg_clipfrac_dual``
        (dual clip active), ``ppo_kl`` (``mean(old_logprobs - logprobs)``), ``ratio_mean/max/min``,
        ``is_weight_mean``.
    """
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"aggregation={aggregation!r} is invalid; allowed: {AGGREGATIONS}")
    if not (_is_number(clip_low) and 0.0 <= clip_low < 1.0) or not (_is_number(clip_high) and clip_high >= 0.0):
        raise ConfigError(
            f"clip_low={clip_low!r}, clip_high={clip_high!r} are invalid; allowed: 0 <= clip_low < 1, clip_high >= 0"
        )
    if dual_clip is not None and not (_is_number(dual_clip) and dual_clip > 1.0):
        raise ConfigError(f"dual_clip={dual_clip!r} is invalid; allowed: None or a number > 1 (DAPO uses 10)")
    if loss_scale_denominator is not None and not (_is_number(loss_scale_denominator) and loss_scale_denominator > 0):
        raise ConfigError(
            f"loss_scale_denominator={loss_scale_denominator!r} is invalid; allowed: None or a number > 0"
        )
    if max_length is not None and not (isinstance(max_length, int) and max_length > 0):
        raise ConfigError(f"max_length={max_length!r} is invalid; allowed: None or an int > 0")

    named = {"logprobs": logprobs, "old_logprobs": old_logprobs, "response_mask": response_mask}
    if is_weights is not None:
        named["is_weights"] = is_weights
    _check_shapes(named)
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    elif advantages.shape != logprobs.shape:
        raise InputError(
            f"shape mismatch: logprobs has shape {tuple(logprobs.shape)} but advantages has shape "
            f"{tuple(advantages.shape)} (expected [B] or [B, T])"
        )
    mask = _bool_mask(response_mask)
    v = _Valid.of(mask)
    # Zero every input on padding before any arithmetic: NaN there must not reach the loss or its
    # gradient, and the per-token loss is then 0 on padding (A = 0) without a final mask.
    lp = _valid_float("logprobs", logprobs, mask)
    lp_old = _valid_float("old_logprobs", old_logprobs.detach(), mask)
    adv = _valid_float("advantages", advantages.detach(), mask)
    w = None if is_weights is None else _valid_float("is_weights", is_weights.detach(), mask)

    ratio = torch.exp((lp - lp_old).clamp(-log_ratio_clamp, log_ratio_clamp))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = (
        loss_tok if dual_clip is None else torch.where(adv < 0, torch.minimum(loss_tok, -dual_clip * adv), loss_tok)
    )
    loss = _aggregate(loss_dual if w is None else loss_dual * w, v, aggregation, loss_scale_denominator, max_length)

    with torch.no_grad():
        ratio_d = ratio.detach()
        stats = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": v.frac(loss_clipped.detach() > loss_unclipped.detach()),  # False on padding (A = 0)
            "pg_clipfrac_high": v.frac((ratio_d > 1.0 + clip_high) & (adv > 0)),
            "pg_clipfrac_low": v.frac((ratio_d < 1.0 - clip_low) & (adv < 0)),
            "pg_clipfrac_dual": v.frac(loss_dual.detach() < loss_tok.detach()) if dual_clip is not None else 0.0,
            "ppo_kl": v.mean(lp_old - lp.detach()),
            "ratio_mean": v.masked_mean(ratio_d),  # the ratio is 1 on padding
            "ratio_max": v.max(ratio_d),
            "ratio_min": v.min(ratio_d),
            "is_weight_mean": v.mean(w) if w is not None else 1.0,
        }
    return loss, _floats(stats)


def _aggregate(
    loss_tok: torch.Tensor, v: _Valid, aggregation: str, denominator: float | None, max_length: int | None
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss (0 on padding) to a scalar; see ``ppo_clip_loss``."""
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
