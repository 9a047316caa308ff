"""`EngineOptions`: the `Engine` keyword arguments resolved and checked, in one place.

The rollout config's fields may be overridden by keyword (``kv_cache_dtype=...``); the sizes
(`max_len`, `max_batch` or `kv_cache_memory`, `max_prefill_tokens`) are checked against the model.
Errors are `ConfigError`s naming the argument, the value and what is allowed (an unavailable CUDA
device: `UnsupportedError`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashrl.core.config import RolloutConfig
from flashrl.core.device import resolve_device, resolve_dtype
from flashrl.core.fields import check_fields, integer, number
from flashrl.engine.kv_cache import KVCache
from flashrl.errors import ConfigError
from flashrl.model.config import ModelConfig
from flashrl.model.kv_scales import scale_granularity

DEFAULT_MAX_PREFILL_TOKENS = 16384
"""Padded prompt tokens per prefill forward unless `Engine(max_prefill_tokens=...)` says
otherwise."""
DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_LEN = 4096
"""`max_len` default, or the model's max_position_embeddings when smaller."""


ROLLOUT_OVERRIDES = (
    "lm_head_fp32", "skip", "kv_cache_dtype", "kv_scale", "sync_rounding", "smooth"
)  # fmt: skip
"""`RolloutConfig` fields that `Engine(..., **overrides)` may set directly."""


@dataclass(frozen=True)
class EngineConfig:
    """How the built-in engine runs (what it quantizes is the `RolloutConfig`). None: the default
    named in each field's docstring."""

    device: str | torch.device | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; default: CUDA when available."""
    dtype: str | torch.dtype | None = None
    """Activation dtype (bf16, fp16, fp32); default bf16."""
    max_batch: int | None = integer(None)
    """Sequences the KV cache holds at once (default 64)."""
    max_len: int | None = None
    """Tokens per sequence, prompt + response (default min(4096, max_position_embeddings))."""
    kv_cache_memory: int | None = number(None, at_least=1, unit="a number of bytes")
    """Bytes of KV cache; `max_batch` then follows from it (give one of the two)."""
    max_prefill_tokens: int | None = integer(None, note="padded prompt tokens per prefill forward")
    """Padded prompt tokens per prefill forward (default 16384); more prompts take more forwards."""
    kv_scale_granularity: str | None = None
    """Static fp8 KV scales per ``layer`` (default) or per kv ``head``."""
    decode_compile: str | None = None
    """None (eager), ``default``, ``reduce-overhead`` (CUDA graphs per shape bucket, CUDA only),
    ``max-autotune``, ``max-autotune-no-cudagraphs``: `torch.compile` of the decode forward."""
    decode_buckets: bool | None = None
    """Pad each decode step to a small set of shapes (default: on exactly when compiled)."""
    seed: int | None = None
    progress: bool = True
    """Show a progress bar on long `generate` calls."""
    load_weights: bool = True
    """False leaves the weights uninitialised (see `Engine.init_random_weights_`)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def split_overrides(
        cls, base: EngineConfig | None, overrides: dict[str, Any]
    ) -> tuple[EngineConfig, dict[str, Any]]:
        """`base` with the `overrides` that name its fields applied, and the `RolloutConfig`
        overrides (`ROLLOUT_OVERRIDES`); any other name is a `ConfigError`, and ``quant`` (the
        old name of `rollout_config`) one that names the new spelling."""
        if "quant" in overrides:
            raise ConfigError(
                f"Engine: quant= was renamed: pass the scheme as rollout_config, "
                f"Engine(model, {overrides['quant']!r}) or rollout_config={overrides['quant']!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields - set(ROLLOUT_OVERRIDES))
        if unknown:
            raise ConfigError(
                f"Engine got unknown argument(s) {unknown}; allowed: EngineConfig fields "
                f"{sorted(fields)} and RolloutConfig overrides {list(ROLLOUT_OVERRIDES)}"
            )
        engine = {k: v for k, v in overrides.items() if k in fields}
        rollout = {k: v for k, v in overrides.items() if k in ROLLOUT_OVERRIDES}
        return dataclasses.replace(base or cls(), **engine), rollout


@dataclass(frozen=True)
class EngineOptions:
    """What an `Engine` runs with, resolved from its keyword arguments."""

    config: RolloutConfig
    kv_scale_granularity: str | None
    """None (unquantized KV cache), ``token`` (dynamic scales), ``layer`` or ``head``."""
    device: torch.device
    dtype: torch.dtype
    max_len: int
    max_batch: int
    max_prefill_tokens: int

    @classmethod
    def resolve(
        cls,
        model_dir: Path,
        model_config: ModelConfig,
        config: RolloutConfig,
        overrides: dict[str, Any],
        engine: EngineConfig,
    ) -> EngineOptions:
        """Apply the non-None `overrides` (fields of `config`), fill in the defaults and check
        the sizes against the model (`engine` checked its own fields when built)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if given:
            config = RolloutConfig.from_dict({**config.to_dict(), **given})
        granularity = scale_granularity(
            config.kv_cache_dtype, config.kv_scale, "kv_scale" in given, engine.kv_scale_granularity
        )
        device, dtype = resolve_device(engine.device), resolve_dtype(engine.dtype)
        max_len = _check_max_len(engine.max_len, model_config, model_dir)
        max_batch = DEFAULT_MAX_BATCH if engine.max_batch is None else engine.max_batch
        if engine.kv_cache_memory is not None:
            if engine.max_batch is not None:
                raise ConfigError("give max_batch or kv_cache_memory, not both")
            max_batch = _max_batch_for(
                int(engine.kv_cache_memory),
                model_config,
                dtype,
                config.kv_cache_dtype,
                granularity or "layer",
                max_len,
            )
        prefill = engine.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS
        return cls(config, granularity, device, dtype, max_len, max_batch, prefill)

    def sync_rounding_generator(
        self, model_config: ModelConfig, seed: int | None
    ) -> torch.Generator | None:
        """The generator of stochastic sync rounding (None: nearest), seeded from the engine seed
        apart from the sampling seeds; refused for MoE models, whose experts round to nearest."""
        if self.config.sync_rounding == "nearest":
            return None
        if model_config.moe is not None:
            raise ConfigError(
                f"sync_rounding={self.config.sync_rounding!r} is not supported for MoE models: "
                "expert weights are re-quantized with nearest rounding; set sync_rounding: nearest"
            )
        return torch.Generator(device=self.device).manual_seed((seed or 0) + 1_000_003)

    def smooth_alpha(self, model_config: ModelConfig) -> float | None:
        """The online smoothing exponent (None: off); refused for MoE models, whose experts are
        not smoothed."""
        if self.config.smooth is not None and model_config.moe is not None:
            raise ConfigError(
                f"smooth={self.config.smooth!r} is not supported for MoE models (experts are "
                "not smoothed); drop smooth"
            )
        return self.config.smooth


def _check_max_len(max_len: int | None, model_config: ModelConfig, model_dir: Path) -> int:
    """`max_len` (default: min(max_position_embeddings, 4096)), an integer within the model's
    positions: RoPE tables and the model were made for max_position_embeddings positions."""
    limit = model_config.max_position_embeddings
    if max_len is None:
        return min(limit, DEFAULT_MAX_LEN)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ConfigError(
            f"max_len={max_len!r} is invalid; allowed: an integer in [2, {limit}] "
            f"(max_position_embeddings of {model_dir / 'config.json'})"
        )
    if max_len > limit:
        raise ConfigError(
            f"max_len={max_len} is more than the model's max_position_embeddings="
            f"{limit} ({model_dir / 'config.json'}); use max_len <= {limit}"
        )
    return max_len


def _max_batch_for(
    budget: int,
    c: ModelConfig,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    granularity: str,
    max_len: int,
) -> int:
    """Slots of `max_len` tokens that fit in `budget` bytes of KV cache."""
    args = (c.num_layers, c.num_kv_heads, c.head_dim, dtype, kv_cache_dtype, granularity)
    tokens = KVCache.capacity_tokens(budget, *args)
    if tokens < max_len:
        need = KVCache.fixed_bytes(
            c.num_layers, c.num_kv_heads, kv_cache_dtype, granularity
        ) + max_len * KVCache.bytes_per_token(*args)
        raise ConfigError(
            f"kv_cache_memory={budget} bytes holds {tokens} tokens, less than one "
            f"sequence of max_len={max_len} ({need} bytes); raise kv_cache_memory "
            "or lower max_len"
        )
    return tokens // max_len
