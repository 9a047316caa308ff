"""The fp8 KV-scale lifecycle of one rollout model, in one object: `KVScaleState`.

Static fp8 KV scales (``kv_scale="calibrated"``) describe the weights they were computed with, so
they go stale whenever the weights change. The state machine, the same for every backend:

- start: stale (no scales yet); the first generate calibrates on the most recent sequences, or on
  its own prompts when there are none;
- `remember` keeps the most recent generated sequences (the calibration set, `RecentSequences`);
- `weights_changed` marks the scales stale; the backend recalibrates right away when it has
  sequences to calibrate on, else at its next generate;
- `record` stores freshly computed scales and their cost (``kv_calibration_*`` stats).

A fixed float `kv_scale` never goes stale; ``"dynamic"`` has no static scales at all. The built-in
engine (`flashrl.engine.Engine`) and the vLLM backend (`flashrl.vllm_backend.kv_scales.KVScaleSync`,
which calibrates on every update and so never stays stale) each keep one `KVScaleState`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashrl.core.config import KV_SCALE_GRANULARITIES
from flashrl.errors import ConfigError, InputError
from flashrl.model.decoder import Decoder
from flashrl.model.kv_calibration import KVScales, RecentSequences, calibrate_model


def scale_granularity(
    kv_cache_dtype: str, kv_scale: str | float, granularity: str | None
) -> str | None:
    """The KV scale granularity: None for an unquantized cache, ``token`` for dynamic scales, else
    ``layer`` (default) or ``head``. A granularity that would have no effect is a `ConfigError`
    (the `RolloutConfig` refuses a `kv_scale` without an fp8 cache itself)."""
    if kv_cache_dtype != "fp8":
        if granularity is not None:
            raise ConfigError(
                f"kv_scale_granularity applies to kv_cache_dtype='fp8' only; this engine has "
                f"kv_cache_dtype={kv_cache_dtype!r}: set kv_cache_dtype='fp8' or leave "
                f"kv_scale_granularity at the default"
            )
        return None
    if kv_scale == "dynamic":
        if granularity not in (None, "token"):
            raise ConfigError(
                f"kv_scale_granularity={granularity!r} does not apply to "
                "kv_scale='dynamic' (dynamic scales are per token and kv head)"
            )
        return "token"
    if granularity not in (None, *KV_SCALE_GRANULARITIES[:2]):
        raise ConfigError(f"kv_scale_granularity={granularity!r} is invalid; allowed: layer, head")
    return granularity or "layer"


class KVScaleState:
    """The fp8 KV scales of one model: mode, the last calibrated scales, whether they are stale,
    the calibration set and the calibration counters (module docstring)."""

    def __init__(self, kv_cache_dtype: str, kv_scale: str | float, granularity: str | None) -> None:
        self.kv_cache_dtype, self.mode, self.granularity = kv_cache_dtype, kv_scale, granularity
        self.calibrated = kv_cache_dtype == "fp8" and kv_scale == "calibrated"
        """Static scales recalibrated after every weight update."""
        self.recent = RecentSequences()
        self.scales: KVScales | None = None
        self.stale = self.calibrated
        """True while the scales do not describe the current weights (calibrated mode only)."""
        self.calibrations, self.seconds, self.last_s, self.last_tokens = 0, 0.0, 0.0, 0

    @property
    def fixed(self) -> float | None:
        """The fixed scale of every layer (a float ``kv_scale`` on an fp8 cache), else None."""
        return self.mode if self.kv_cache_dtype == "fp8" and isinstance(self.mode, float) else None

    def initial(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (k, v) scales a newly built cache starts with: the fixed value, the last calibrated
        scales, or None (leave the cache's defaults)."""
        if self.fixed is not None:
            return torch.tensor(self.fixed), torch.tensor(self.fixed)
        if self.scales is not None:
            return self.scales.k, self.scales.v
        return None

    def remember(self, sequences: Sequence[Sequence[int]]) -> None:
        """Add generated sequences (prompt + response, most important first) to the calibration
        set (calibrated mode only)."""
        if self.calibrated:
            self.recent.add(sequences)

    def weights_changed(self) -> None:
        """The weights changed: calibrated scales are stale until the next `record`."""
        if self.calibrated:
            self.stale = True

    def calibration_set(self, sequences: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """`sequences` cut to the token budget of the automatic calibration set, or (None) the most
        recent generated sequences."""
        if sequences is None:
            return self.recent.sequences()
        budget = RecentSequences(self.recent.max_tokens, self.recent.max_seq_tokens)
        budget.add(list(sequences))
        return budget.sequences()

    def calibrate(
        self, model: Decoder, sequences: Sequence[Sequence[int]] | None, max_len: int
    ) -> KVScales:
        """Scales from a forward of `model` over `calibration_set(sequences)` (calibrated mode
        only; `record` stores them)."""
        if not self.calibrated:
            raise ConfigError(
                "calibrate_kv needs kv_cache_dtype='fp8' with "
                f"kv_scale='calibrated'; this engine has "
                f"kv_cache_dtype={self.kv_cache_dtype!r}, kv_scale={self.mode!r}"
            )
        sequences = self.calibration_set(sequences)
        if not sequences:
            raise InputError("no calibration sequences: pass token ids, or generate first")
        return calibrate_model(model, sequences, self.granularity, max_len=max_len)

    def record(self, scales: KVScales, seconds: float) -> float:
        """Store freshly calibrated `scales` (no longer stale) and their cost; returns `seconds`."""
        self.scales, self.stale = scales, False
        self.calibrations += 1
        self.seconds += seconds
        self.last_s, self.last_tokens = seconds, scales.tokens
        return seconds

    def stats(self) -> dict[str, float]:
        """``kv_calibrations``, ``kv_calibration_s`` (total), ``kv_calibration_last_s`` and
        ``kv_calibration_tokens`` (of the last calibration)."""
        return {
            "kv_calibrations": self.calibrations,
            "kv_calibration_s": self.seconds,
            "kv_calibration_last_s": self.last_s,
            "kv_calibration_tokens": self.last_tokens,
        }
