"""The profile document as dataclasses: `ProfileResult` and its parts. `ProfileResult.to_dict` is
the JSON written by `flashrl profile` (field by field in docs/profile.md); `flashrl setup` reads that
JSON back. Mismatch and per-layer error maps stay plain dicts: their keys are metric and scheme
names (`flashrl.tools.profile_metrics`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flashrl.tools.checks import strict_json

Mismatch = dict[str, Any]
"""``{"exact", "kv_cache", "sampled", "decode_tok_s"}`` (`profile_metrics.distribution_mismatch`
and friends; the engine's decode tokens/s while it sampled)."""


@dataclass
class ModelSummary:
    path: str
    family: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool


@dataclass
class ProfileSettings:
    schemes: list[str]
    threshold: float
    kv_cache_dtype: str
    lm_head_fp32: bool
    seed: int
    max_prompt_tokens: int
    max_new_tokens: int
    temperature: float
    smooth: float | None = None


@dataclass
class CalibrationSummary:
    """Where the calibration prompts came from and how many tokens they and their responses hold."""

    source: str
    """``builtin``, ``file`` or ``random_token_ids`` (a model without a tokenizer)."""
    file: str | None
    note: str | None
    num_sequences: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    positions: int = 0


@dataclass
class WeightMemory:
    weight_bytes_bf16: int
    weight_bytes: int
    weight_bytes_after_skip: int
    ratio: float
    ratio_after_skip: float


@dataclass
class SchemeProfile:
    """``schemes.<scheme>``: layer errors, the skip recommendation, mismatch before and after."""

    output_error_median: float
    output_error_max: float
    flagged: list[dict[str, Any]]
    recommended_skip: list[str]
    skip: list[str]
    mismatch: Mismatch
    mismatch_after_skip: Mismatch | None
    memory: WeightMemory
    skip_trials: list[dict[str, Any]] = field(default_factory=list)
    """Every flagged layer tried, worst first: ``names``, ``output_error``, the exact end-to-end
    ``kl`` with it kept in bf16 (on top of those kept before), ``kept`` (it lowered the KL)."""
    smoothing: dict[str, Any] | None = None
    """Online smoothing tried on top of `skip`: ``alpha``, the exact ``kl`` with it, ``kept`` (it
    lowered the KL), ``reason`` (why it was not tried); None: not asked for."""
    recommended_smooth: float | None = None
    """``alpha`` when smoothing lowered the KL (`flashrl setup` writes it as ``smooth``), else None."""
    mismatch_after_smooth: Mismatch | None = None
    """The mismatch with `skip` and smoothing, when smoothing is recommended."""


@dataclass
class KVCacheProfile:
    """``kv_cache``: bf16 weights with the quantized KV cache; `kv_only` holds ``kv_cache`` alone
    (older profiles also ``sampled`` and ``decode_tok_s``)."""

    dtype: str
    kv_scale: str | float
    bytes_per_token_bf16: int
    bytes_per_token: int
    kv_only: Mismatch


@dataclass
class ProfileResult:
    """The profile of one model (`flashrl.tools.profile.run_profile`)."""

    schema_version: int
    flashrl_version: str
    created: str
    model: ModelSummary
    device: str
    device_name: str
    dtype: str
    settings: ProfileSettings
    calibration: CalibrationSummary
    layers: list[dict[str, Any]]
    baseline: dict[str, Any]
    """``sampled``: the bf16 floor (cached vs no-cache); ``decode_tok_s``: the bf16 engine's."""
    schemes: dict[str, SchemeProfile] = field(default_factory=dict)
    kv_cache: KVCacheProfile | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    """Wall seconds of each stage (the stage names of the progress bar)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (non-finite numbers as None: strict JSON)."""
        return strict_json(dataclasses.asdict(self))
