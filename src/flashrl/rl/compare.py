"""`run.compare`: several rollout precisions run one after another (parsed here).

A variant is a weight scheme (`bf16`, `int8`, `fp8`, ...; `bf16` also sets the rollout dtype to
bf16), or `fp32` / `fp16`: unquantized rollouts in that dtype (`fp32` is the trainer's own precision
in an fp32 run: the reference a quantized run is compared with); optionally followed by ``-sq``
(online smoothing, ``rollout.smooth: 0.5``), ``-sr`` (stochastic rounding at weight update,
``rollout.sync_rounding: stochastic``) and ``-notis`` (no importance weight), e.g. ``bf16-sr``,
``int8-sq``, ``int8-sr-notis``."""

from __future__ import annotations

from typing import Any

from flashrl.errors import ConfigError
from flashrl.quant.schemes import get_scheme

__all__ = ["UNQUANTIZED", "compare_variants"]

UNQUANTIZED = ("fp32", "fp16")
"""Variant names for unquantized rollouts in a dtype other than bf16."""
FLAGS = ("sq", "sr", "notis")
SMOOTH_VARIANT_ALPHA = 0.5
"""The smoothing exponent of a ``-sq`` variant (the best of benchmarks/mismatch_levers_sim.py)."""
"""Variant suffixes, in the order variant names spell them."""


def compare_variants(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """'bf16,int8,int8-notis' -> [(name, dotted overrides)], '-notis' meaning no importance weight
    (`variant_configs` applies it to TIS weights only, as ``tis_cap: 0`` did). Each variant is one
    run directory, so a variant listed twice (also in another spelling, e.g. INT8) is a
    ConfigError."""
    out, seen = [], {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        scheme, *flags = item.split("-")
        unknown = sorted(set(f.lower() for f in flags) - set(FLAGS))
        if unknown or len(set(flags)) != len(flags):
            raise ConfigError(
                f"run.compare={spec!r}: {item!r} has suffix(es) {unknown or flags}; allowed "
                f"after a scheme, once each: {', '.join('-' + f for f in FLAGS)}"
            )
        lowered = [f.lower() for f in flags]
        no_tis, stochastic, smooth = "notis" in lowered, "sr" in lowered, "sq" in lowered
        overrides: dict[str, Any] = {}
        if scheme.lower() in UNQUANTIZED:
            name = scheme.lower()
            overrides = {"rollout.quant": "bf16", "rollout.dtype": name}
        else:
            try:
                name = get_scheme(scheme).name
            except ValueError as err:
                raise ConfigError(
                    f"run.compare={spec!r}: {err} (or an unquantized dtype: "
                    f"{', '.join(UNQUANTIZED)})"
                ) from None
            overrides = {"rollout.quant": name}
            if name == "bf16":
                overrides["rollout.dtype"] = "bf16"
        key = name + "".join(f"-{f}" for f, on in zip(FLAGS, (smooth, stochastic, no_tis)) if on)
        if key in seen:
            raise ConfigError(
                f"run.compare={spec!r} lists {key!r} twice ({seen[key]!r} and "
                f"{item!r}); each variant is one run directory under output_dir: "
                f"list it once"
            )
        seen[key] = item
        if no_tis:
            overrides["correction.weight"] = "none"
        if stochastic:
            overrides["rollout.sync_rounding"] = "stochastic"
        if smooth:
            overrides["rollout.smooth"] = SMOOTH_VARIANT_ALPHA
        out.append((key, overrides))
    if not out:
        raise ConfigError(
            f"run.compare={spec!r} needs at least one scheme, e.g. bf16,int8,int8-notis"
        )
    return out


def rollout_name(config: Any) -> str:
    """The rollout precision of a `TrainConfig` in words: the scheme, or the dtype of unquantized
    rollouts (the variant name `compare_variants` gives it)."""
    quant, dtype = config.rollout.quant, config.rollout.dtype
    return dtype if quant == "bf16" and dtype != "bf16" else quant
