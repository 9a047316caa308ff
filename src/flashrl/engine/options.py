"""`EngineOptions`: the `Engine` keyword arguments resolved and checked, in one place.

The rollout config's fields may be overridden by keyword (``kv_cache_dtype=...``); the sizes
(`max_len`, `max_batch` or `kv_cache_memory`, `max_prefill_tokens`) are checked against the model.
Errors are `ConfigError`s naming the argument, the value and what is allowed (an unavailable CUDA
device: `UnsupportedError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashrl.core.config import RolloutConfig
from flashrl.core.device import resolve_device, resolve_dtype
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


def _positive_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


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
        kv_scale_granularity: str | None,
        device: str | torch.device | None,
        dtype: str | torch.dtype | None,
        max_batch: int | None,
        max_len: int | None,
        kv_cache_memory: int | None,
        max_prefill_tokens: int | None,
    ) -> EngineOptions:
        """Apply the non-None `overrides` (fields of `config`) and check every size."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if given:
            config = RolloutConfig.from_dict({**config.to_dict(), **given})
        granularity = scale_granularity(
            config.kv_cache_dtype, config.kv_scale, "kv_scale" in given, kv_scale_granularity
        )
        device, dtype = resolve_device(device), resolve_dtype(dtype)
        max_len = _check_max_len(max_len, model_config, model_dir)
        if kv_cache_memory is not None:
            if max_batch is not None:
                raise ConfigError("give max_batch or kv_cache_memory, not both")
            max_batch = _max_batch_for(
                kv_cache_memory,
                model_config,
                dtype,
                config.kv_cache_dtype,
                granularity or "layer",
                max_len,
            )
        max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
        if not _positive_int(max_batch):
            raise ConfigError(f"max_batch={max_batch!r} is invalid; allowed: an integer >= 1")
        if max_prefill_tokens is None:
            max_prefill_tokens = DEFAULT_MAX_PREFILL_TOKENS
        if not _positive_int(max_prefill_tokens):
            raise ConfigError(
                f"max_prefill_tokens={max_prefill_tokens!r} must be a positive int "
                "(padded prompt tokens per prefill forward)"
            )
        return cls(config, granularity, device, dtype, max_len, max_batch, max_prefill_tokens)


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
    kv_cache_memory: object,
    c: ModelConfig,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    granularity: str,
    max_len: int,
) -> int:
    """Slots of `max_len` tokens that fit in `kv_cache_memory` bytes of KV cache."""
    number = not isinstance(kv_cache_memory, bool) and isinstance(kv_cache_memory, (int, float))
    if not number or not kv_cache_memory >= 1:
        raise ConfigError(f"kv_cache_memory={kv_cache_memory!r} must be a positive number of bytes")
    budget = int(kv_cache_memory)
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
