"""`EngineOptions`: the `Engine`'s two configs resolved and checked, in one place.

`Engine` takes its settings only in a `RolloutConfig` (what is quantized) and an `EngineConfig` (how
it runs); `engine_config_of` refuses anything else, saying where each keyword goes. The sizes
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
"""Padded prompt tokens per prefill forward unless `EngineConfig(max_prefill_tokens=...)` says
otherwise."""
DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_LEN = 4096
"""`max_len` default, or the model's max_position_embeddings when smaller."""


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
    cpu_mirror_memory: int | None = integer(None, least=0, note="0: no fp32 weight copies")
    """CPU engines: bytes of fp32 weight copies kept for the GEMMs (`flashrl.quant.cpu_mirror`;
    layers past it convert per call, slower, same outputs). Default: a quarter of physical memory."""

    def __post_init__(self) -> None:
        check_fields(self)


def engine_config_of(
    rollout_config: Any, engine_config: Any, unexpected: dict[str, Any]
) -> EngineConfig:
    """`engine_config` (None: the defaults) of an `Engine` given no other keyword: a field of
    either config as a keyword (``max_batch=8``, ``quant="int8"``) is a `ConfigError` naming the
    config it goes in, any other name one listing the fields of both; an `EngineConfig` in the
    rollout config's place one saying where it goes."""
    if unexpected:
        raise ConfigError(_misplaced_message(unexpected))
    if isinstance(rollout_config, EngineConfig):
        raise ConfigError(
            "rollout_config must be a scheme name, a YAML path or a RolloutConfig, got a "
            "EngineConfig (an engine's EngineConfig goes in engine_config, after the rollout config)"
        )
    if engine_config is None:
        return EngineConfig()
    if not isinstance(engine_config, EngineConfig):
        raise ConfigError(
            f"engine_config must be an EngineConfig or None, got {type(engine_config).__name__}; "
            "build one: EngineConfig(max_batch=8, ...)"
        )
    return engine_config


def _misplaced_message(kwargs: dict[str, Any]) -> str:
    """Where each keyword an `Engine` was given goes instead."""
    engine = [f.name for f in dataclasses.fields(EngineConfig)]
    rollout = [f.name for f in dataclasses.fields(RolloutConfig)]
    names, homes = list(kwargs), []
    if to_engine := [n for n in names if n in engine]:
        homes.append(f"EngineConfig({'=..., '.join(to_engine)}=...) as engine_config")
    if to_rollout := [n for n in names if n in rollout]:
        home = f"a RolloutConfig({'=..., '.join(to_rollout)}=...) as rollout_config"
        if "quant" in kwargs:
            home += f" (or the scheme alone: Engine(model, {kwargs['quant']!r}))"
        homes.append(home)
    message = f"Engine got keyword argument(s) {', '.join(names)}; "
    if homes:
        message += f"pass them in a config: {', '.join(homes)}"
    if unknown := [n for n in names if n not in engine and n not in rollout]:
        message += (
            f"{'; ' if homes else ''}{', '.join(unknown)}: no such setting (Engine takes model_dir, "
            f"rollout_config, engine_config; EngineConfig fields: {', '.join(engine)}; "
            f"RolloutConfig fields: {', '.join(rollout)})"
        )
    return message


@dataclass(frozen=True)
class EngineOptions:
    """What an `Engine` runs with, resolved from its two configs."""

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
        engine: EngineConfig,
    ) -> EngineOptions:
        """Fill in the defaults and check the sizes against the model (`config` and `engine`
        checked their own fields when built)."""
        granularity = scale_granularity(
            config.kv_cache_dtype, config.kv_scale, engine.kv_scale_granularity
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
