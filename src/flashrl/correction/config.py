"""``CorrectionConfig``: how to weight and reject tokens, validated on construction; named presets.

The option names follow verl's ``RolloutCorrectionConfig`` (``verl/trainer/config/algorithm.py``);
the presets mirror its factory methods (table in ``docs/correction.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from flashrl.correction.options import (
    DEFAULT_REJECTION_THRESHOLDS,
    ICEPOP_BAND,
    MODES,
    REJECTION_OPTIONS,
    WEIGHTS,
    Threshold,
    as_pair,
    check_band,
    fail,
    parse_field,
    resolve_threshold,
)
from flashrl.errors import ConfigError
from flashrl.masked import LOG_RATIO_CLAMP, is_number

__all__ = ["PRESETS", "CorrectionConfig"]


@dataclass(frozen=True)
class CorrectionConfig:
    """How to weight and reject tokens; validated on construction (see ``docs/correction.md``).

    Presets (classmethods, after verl's factory methods): ``disabled``, ``token_tis``, ``seq_tis``,
    ``token_mis``, ``seq_mis``, ``seq_is_rs``, ``geo_rs``, ``k3_rs``; ``from_preset(name, **kw)``.
    """

    mode: str = "decoupled"
    """``decoupled`` (ratio = pi_old / pi_roll) or ``bypass`` (ratio = pi_cur / pi_roll; IS weights
    are then computed for metrics only, never multiplied into a PPO-clip loss)."""
    weight: str = "token_tis"
    """``none``, ``token_tis``, ``token_mis``, ``seq_tis`` or ``seq_mis``."""
    cap: float = 2.0
    """C for the ``*_tis`` weights, the upper bound of ``seq_mis`` when no band is given, and the
    diagnostic band ``[1/C, C]`` of the ``rollout_is_*`` metrics (a ``*_mis`` weight uses its band
    there, as verl does). Must be >= 1."""
    band: tuple[float, float] | None = None
    """``(lo, hi)`` on rho for ``token_mis`` / ``seq_mis``; None means ``ICEPOP_BAND`` for
    ``token_mis`` and ``(0, cap)`` for ``seq_mis``. Other weights reject a band."""
    rejection: tuple[str, ...] = ()
    """verl ``rollout_rs`` option names, plus flashrl's ``token_rho``, ``seq_sum_rho``,
    ``seq_mean_rho`` (``REJECTION_OPTIONS``), AND-combined."""
    rejection_thresholds: tuple[Threshold, ...] = ()
    """One entry per option, or one entry broadcast to all, or empty for the defaults
    (``DEFAULT_REJECTION_THRESHOLDS``, and ``(1/cap, cap)`` for ``token_k1`` and ``token_rho``). A
    k1 option takes ``(lo, hi)`` bounds on ``exp(k1) = 1/rho`` (verl's rule), a rho option the same
    bounds on rho itself; a bare ``x`` means ``(1/x, x)`` (the same band either way). k2 and k3
    options take an upper bound."""
    batch_normalize: bool = False
    """Divide the weights by their mean over every valid token, before rejection (verl's order;
    ``seq_*``: over the sequences with a valid token). Decoupled mode only."""
    log_ratio_clamp: float = LOG_RATIO_CLAMP
    """Log-ratios are clamped to +-this before ``exp``."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            fail("mode", self.mode, str(MODES))
        if self.weight not in WEIGHTS:
            fail("weight", self.weight, str(WEIGHTS))
        if not (is_number(self.cap) and 1.0 <= self.cap < math.inf):
            fail(
                "cap", self.cap, "a finite number >= 1 (it truncates rho from above; typical 1.5-5)"
            )
        if not (is_number(self.log_ratio_clamp) and 0.0 < self.log_ratio_clamp <= 80.0):
            fail(
                "log_ratio_clamp",
                self.log_ratio_clamp,
                "a number in (0, 80] (exp must stay finite in fp32)",
            )
        if not isinstance(self.batch_normalize, bool):
            fail("batch_normalize", self.batch_normalize, "True or False")
        if self.band is not None:
            band = as_pair("band", self.band)
            check_band("band", band)
            object.__setattr__(self, "band", band)
            if self.weight not in ("token_mis", "seq_mis"):
                fail(
                    "band",
                    self.band,
                    f"None unless weight is 'token_mis' or 'seq_mis' (weight={self.weight!r})",
                )
        object.__setattr__(self, "cap", float(self.cap))
        object.__setattr__(self, "log_ratio_clamp", float(self.log_ratio_clamp))
        self._check_rejection()
        if self.batch_normalize and self.weight == "none":
            fail(
                "batch_normalize",
                True,
                "False when weight='none' (there are no weights to normalize)",
            )
        if self.mode == "bypass":
            self._check_bypass()

    def _check_bypass(self) -> None:
        # In bypass mode the PPO ratio already divides by pi_roll, so Correction.weights carries
        # only the rejection mask: a masking weight or a normalization would silently do nothing.
        if self.weight in ("token_mis", "seq_mis"):
            fail(
                "weight",
                self.weight,
                "'none', 'token_tis' or 'seq_tis' in bypass mode (IS weights are "
                "metrics-only there); to drop tokens or sequences use rejection=('token_k1',) or "
                "('seq_sum_k1',) with the same band",
            )
        if self.batch_normalize:
            fail(
                "batch_normalize",
                True,
                "False in bypass mode (IS weights are not applied to the loss)",
            )

    def _check_rejection(self) -> None:
        options = tuple(self.rejection) if isinstance(self.rejection, (tuple, list)) else None
        if options is None:
            fail("rejection", self.rejection, f"a tuple of option names from {REJECTION_OPTIONS}")
        for option in options:
            if option not in REJECTION_OPTIONS:
                fail(
                    "rejection",
                    self.rejection,
                    f"option names from {REJECTION_OPTIONS}; {option!r} is not one",
                )
        if len(set(options)) != len(options):
            fail("rejection", self.rejection, "each option at most once")
        thresholds = self.rejection_thresholds
        if not isinstance(thresholds, (tuple, list)):
            fail("rejection_thresholds", thresholds, "a tuple of numbers or (lo, hi) pairs")
        thresholds = tuple(tuple(t) if isinstance(t, list) else t for t in thresholds)
        if thresholds and not options:
            fail("rejection_thresholds", thresholds, "() when rejection is empty")
        if len(thresholds) not in (0, 1, len(options)):
            fail(
                "rejection_thresholds",
                thresholds,
                f"one threshold per option ({len(options)}), one shared threshold, "
                "or () for the defaults",
            )
        object.__setattr__(self, "rejection", options)
        object.__setattr__(self, "rejection_thresholds", thresholds)
        self.rejection_bounds()  # validates every threshold

    def rejection_bounds(self) -> dict[str, tuple[float, float]]:
        """Resolved threshold per rejection option: ``(lo, hi)`` on ``exp(k1)`` for k1 options and
        on rho for rho options, ``(0, hi)`` on the statistic for k2/k3 options."""
        thresholds = self.rejection_thresholds
        if len(thresholds) == 1:
            thresholds = thresholds * len(self.rejection)
        bounds = {}
        for i, option in enumerate(self.rejection):
            if thresholds:
                spec = thresholds[i]
            elif option in ("token_k1", "token_rho"):
                spec = (1.0 / self.cap, self.cap)
            elif option in DEFAULT_REJECTION_THRESHOLDS:
                spec = DEFAULT_REJECTION_THRESHOLDS[option]
            else:
                fail(
                    "rejection_thresholds",
                    (),
                    f"explicit thresholds: {option!r} has no default "
                    "(defaults exist for token_k1, token_rho, "
                    f"{', '.join(DEFAULT_REJECTION_THRESHOLDS)})",
                )
            bounds[option] = resolve_threshold(option, spec)
        return bounds

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CorrectionConfig:
        """Build from a mapping such as a YAML section. Lists become tuples; ``band``, ``rejection``
        and ``rejection_thresholds`` also accept verl-style strings (``"0.5_5.0"``,
        ``"seq_mean_k1,seq_mean_k3"``, ``"0.999_1.001,0.01"``); scalars may be strings."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown CorrectionConfig keys {unknown}; allowed: {sorted(known)}")
        return cls(**{key: parse_field(key, value) for key, value in values.items()})

    @classmethod
    def from_string(cls, spec: str) -> CorrectionConfig:
        """Build from whitespace-separated ``key=value`` pairs (for a CLI flag), for example
        ``"weight=token_mis band=0.5_5.0 rejection=seq_mean_k1,seq_mean_k3
        rejection_thresholds=0.999_1.001,0.01"``."""
        values = {}
        for item in spec.split():
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"correction spec item {item!r} is not key=value (in {spec!r})")
            values[key] = value
        return cls.from_dict(values)

    # ------------------------------------------------------------------------------------------
    # Presets: verl's RolloutCorrectionConfig factory methods, in flashrl's terms

    @classmethod
    def disabled(cls, *, mode: str = "decoupled") -> CorrectionConfig:
        """Metrics only: no IS weight, no rejection (verl ``disabled``, ``bypass_ppo_clip``)."""
        return cls(mode=mode, weight="none")

    @classmethod
    def token_tis(
        cls, cap: float = 2.0, *, mode: str = "decoupled", batch_normalize: bool = False
    ) -> CorrectionConfig:
        """Token TIS ``min(rho_t, C)`` (verl ``decoupled_token_is``); the default config."""
        return cls(mode=mode, weight="token_tis", cap=cap, batch_normalize=batch_normalize)

    @classmethod
    def seq_tis(
        cls, cap: float = 2.0, *, mode: str = "decoupled", batch_normalize: bool = False
    ) -> CorrectionConfig:
        """Sequence TIS ``min(prod_t rho_t, C)`` (verl ``decoupled_seq_is``)."""
        return cls(mode=mode, weight="seq_tis", cap=cap, batch_normalize=batch_normalize)

    @classmethod
    def token_mis(cls, band: tuple[float, float] = ICEPOP_BAND) -> CorrectionConfig:
        """IcePop: ``rho_t`` inside ``band``, else 0 (verl ``decoupled_token_icepop``)."""
        return cls(weight="token_mis", band=band)

    @classmethod
    def seq_mis(cls, band: tuple[float, float] = (0.0, 2.0)) -> CorrectionConfig:
        """Sequence-level IcePop: ``prod_t rho_t`` inside ``band``, else 0 (verl
        ``rollout_is=sequence`` with a ``"lo_hi"`` threshold)."""
        return cls(weight="seq_mis", band=band)

    @classmethod
    def seq_is_rs(
        cls, cap: float = 2.0, band: tuple[float, float] = (0.5, 2.0), *, mode: str = "decoupled"
    ) -> CorrectionConfig:
        """Seq-MIS: sequence TIS plus ``seq_sum_k1`` rejection (verl ``decoupled_seq_is_rs``)."""
        return cls(
            mode=mode,
            weight="seq_tis",
            cap=cap,
            rejection=("seq_sum_k1",),
            rejection_thresholds=(band,),
        )

    @classmethod
    def geo_rs(
        cls,
        band: tuple[float, float] = (0.999, 1.001),
        *,
        weight: str = "none",
        cap: float = 2.0,
        mode: str = "decoupled",
    ) -> CorrectionConfig:
        """Geo-RS: ``seq_mean_k1`` rejection, optionally with a ``token_tis`` / ``seq_tis`` weight
        (verl ``decoupled_geo_rs``, ``decoupled_geo_rs_{seq,token}_tis``,
        ``bypass_ppo_clip_geo_rs``)."""
        return cls(
            mode=mode,
            weight=weight,
            cap=cap,
            rejection=("seq_mean_k1",),
            rejection_thresholds=(band,),
        )

    @classmethod
    def k3_rs(
        cls,
        threshold: float = 0.01,
        *,
        weight: str = "none",
        cap: float = 2.0,
        mode: str = "decoupled",
    ) -> CorrectionConfig:
        """K3-RS: ``seq_mean_k3`` rejection, optionally with a weight (verl ``decoupled_k3_rs``,
        ``decoupled_k3_rs_{seq,token}_tis``, ``bypass_ppo_clip_k3_rs``)."""
        return cls(
            mode=mode,
            weight=weight,
            cap=cap,
            rejection=("seq_mean_k3",),
            rejection_thresholds=(threshold,),
        )

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> CorrectionConfig:
        """The preset ``name`` (a key of ``PRESETS``) with its keyword arguments."""
        if name not in PRESETS:
            raise ConfigError(
                f"correction preset {name!r} is unknown; allowed: {', '.join(PRESETS)}"
            )
        return getattr(cls, name)(**kwargs)


PRESETS: tuple[str, ...] = (
    "disabled",
    "token_tis",
    "seq_tis",
    "token_mis",
    "seq_mis",
    "seq_is_rs",
    "geo_rs",
    "k3_rs",
)
"""Names of the ``CorrectionConfig`` preset classmethods."""
