"""The option names, defaults and value parsers of ``CorrectionConfig``, defined once.

The names follow verl's ``RolloutCorrectionConfig`` (``verl/trainer/config/algorithm.py``) and
``rollout_corr_helper.py`` (``SUPPORTED_ROLLOUT_RS_OPTIONS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from flashrl.core.env import parse_bool
from flashrl.errors import ConfigError
from flashrl.masked import is_number

__all__ = [
    "BAND_KINDS",
    "DEFAULT_REJECTION_THRESHOLDS",
    "ICEPOP_BAND",
    "MODES",
    "REJECTION_OPTIONS",
    "WEIGHTS",
    "Threshold",
    "as_pair",
    "check_band",
    "fail",
    "parse_field",
    "parse_float",
    "parse_threshold",
    "resolve_threshold",
    "split_option",
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
    "token_rho",
    "seq_sum_rho",
    "seq_mean_rho",
)
"""verl's ``rollout_rs`` options (``SUPPORTED_ROLLOUT_RS_OPTIONS``), then flashrl's ``*_rho``
options: the k1 rejection with its ``(lo, hi)`` bounds on rho = pi_train / pi_roll instead of
verl's ``exp(k1) = 1 / rho``."""

BAND_KINDS = ("k1", "rho")
"""Statistics whose threshold is a ``(lo, hi)`` band (the others take an upper bound)."""

ICEPOP_BAND = (0.5, 5.0)
"""Default ``band`` of ``token_mis`` (IcePop paper, OpenRLHF)."""

DEFAULT_REJECTION_THRESHOLDS: dict[str, float | tuple[float, float]] = {
    "seq_sum_k1": (0.5, 2.0),  # Seq-MIS, verl preset decoupled_seq_is_rs
    "seq_mean_k1": (0.999, 1.001),  # Geo-RS, verl presets: +-0.1% per-token geometric drift
    "seq_mean_k3": 0.01,  # verl K3 rejection
    "seq_sum_rho": (0.5, 2.0),
    "seq_mean_rho": (0.999, 1.001),
}
"""Thresholds used when ``rejection_thresholds`` is empty. ``token_k1`` and ``token_rho`` default
to ``(1/cap, cap)``; the other options have no documented default and need explicit thresholds."""

Threshold = float | tuple[float, float]


def fail(name: str, value: Any, allowed: str) -> NoReturn:
    raise ConfigError(f"CorrectionConfig.{name}={value!r} is invalid; allowed: {allowed}")


def as_pair(name: str, value: Any) -> tuple[float, float]:
    """``value`` as a ``(lo, hi)`` pair of floats, or a ``ConfigError`` naming ``name``."""
    if not (
        isinstance(value, (tuple, list)) and len(value) == 2 and all(is_number(v) for v in value)
    ):
        fail(name, value, "a pair (lo, hi) of numbers")
    return float(value[0]), float(value[1])


def split_option(option: str) -> tuple[str, str]:
    """``"seq_mean_k1"`` -> ``("seq_mean", "k1")``: the level and the statistic of an option."""
    level, kind = option.rsplit("_", 1)
    return level, kind


def check_band(name: str, band: tuple[float, float], on: str = "rho = pi_train / pi_roll") -> None:
    lo, hi = band
    if not (0.0 <= lo < hi):
        fail(name, band, f"0 <= lo < hi (bounds on {on})")
    if not (lo <= 1.0 <= hi):
        fail(
            name,
            band,
            "a band with lo <= 1 <= hi (one excluding rho = 1 would drop on-policy tokens)",
        )


def parse_float(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"CorrectionConfig.{key}={text!r} is not a number") from None


THRESHOLD_FORMATS = {
    "band": "lo_hi with an underscore between the bounds and lo <= 1 <= hi, e.g. 0.5_5.0",
    "rejection_thresholds": "comma-separated thresholds in the order of rejection, each lo_hi "
    "(e.g. 0.999_1.001) or one upper bound (e.g. 0.01)",
}
"""The string forms of ``band`` and ``rejection_thresholds``, for error messages."""


def parse_threshold(key: str, value: Any) -> Threshold:
    """A threshold from YAML or a flag: ``"lo_hi"`` -> ``(lo, hi)``, ``"x"`` -> ``x``; a list
    becomes a tuple."""
    if isinstance(value, str):
        parts = value.strip().split("_")
        try:
            if len(parts) == 2:
                return (parse_float(key, parts[0]), parse_float(key, parts[1]))
            return parse_float(key, value)
        except ConfigError:
            fail(key, value, THRESHOLD_FORMATS.get(key, "a number"))
    if isinstance(value, list):
        return tuple(value)
    return value


def resolve_threshold(option: str, spec: Any) -> tuple[float, float]:
    """The ``(lo, hi)`` bounds of one rejection option: a band for k1 (on ``exp(k1) = 1/rho``, as in
    verl) and rho options (on rho), where a bare ``x`` means ``(1/x, x)``; ``(0, hi)`` on the
    statistic for k2 and k3 options."""
    name = f"rejection_thresholds[{option}]"
    kind = split_option(option)[1]
    if kind in BAND_KINDS:
        if is_number(spec):
            spec = (1.0 / spec, float(spec)) if spec > 0 else (float(spec), float(spec))
        bounds = as_pair(name, spec)
        on = "rho = pi_train / pi_roll" if kind == "rho" else "exp(k1) = pi_roll / pi_train"
        check_band(name, bounds, on)
        return bounds
    if not (is_number(spec) and spec > 0):
        fail(name, spec, f"a single upper bound > 0 for the {kind} statistic (no (lo, hi) pair)")
    return (0.0, float(spec))


def split_list(value: Any) -> Any:
    return value.split(",") if isinstance(value, str) else (value or ())


FIELD_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "cap": lambda key, v: parse_float(key, v) if isinstance(v, str) else v,
    "log_ratio_clamp": lambda key, v: parse_float(key, v) if isinstance(v, str) else v,
    "batch_normalize": lambda key, v: (
        parse_bool(f"CorrectionConfig.{key}", v) if isinstance(v, str) else v
    ),
    "band": lambda key, v: None if v in (None, "", "none") else parse_threshold(key, v),
    "rejection": lambda key, v: tuple(
        s.strip() for s in split_list(v) if s.strip() and s.strip() != "none"
    ),
    "rejection_thresholds": lambda key, v: tuple(
        parse_threshold(key, t) for t in split_list(v) if not (isinstance(t, str) and not t.strip())
    ),
}


def parse_field(key: str, value: Any) -> Any:
    parser = FIELD_PARSERS.get(key)
    return value if parser is None else parser(key, value)
