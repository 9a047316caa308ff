"""FP8 KV-cache scales for a running ``vllm.LLM``: calibrated with flashrl's code, set again after
every weight update.

vLLM keeps one ``k_scale`` / ``v_scale`` per attention layer (per tensor) and, for a model without
a KV-cache quantization method (every online-quantized or unquantized model), resets them to 1.0 on
each reload. A scale of 1.0 clips K/V beyond +-448 and gives values below 2^-6 only subnormal
precision. `KVScaleSync` therefore sets the scales after the engine starts and after every
`WeightUpdater.update_weights`:

- ``kv_scale="calibrated"``: `flashrl.model.kv_calibration.calibrate_from_weights` runs flashrl's
  decoder one layer at a time over the new tensors (on their device, in the engine's dtype and
  weight scheme) and a calibration set: the most recent rollouts (`remember`, fed by
  `VLLMBackend.generate`), else seeded random token ids. Same rule as the built-in engine: K amax
  is the RoPE-pair norm, ``scale = amax * 2 / 448``; Q gets a scale too (used by the CUDA backends
  that quantize Q for FP8 attention). vLLM's forward is not hooked, so CUDA graphs and compilation
  are untouched; the cost is one extra forward over the calibration set on the trainer side.
- a float: every K and V scale is set to it.

The scales reach the workers through ``collective_rpc("flashrl_set_kv_scales", ...)``, which fills
``_k_scale`` / ``_v_scale`` / ``_q_scale`` in place and their host copies (``_k_scale_float``,
``_k_scale_cpu``, ...). At start-up the scales come from the checkpoint on disk (unless
``load_format="dummy"``, whose random weights make any scale meaningless until the first update).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flashrl.errors import ConfigError, InputError, WeightError
from flashrl.model.config import ModelConfig
from flashrl.model.kv_calibration import (
    KVScales,
    RecentSequences,
    calibrate_from_weights,
    calibration_tensor_names,
    checkpoint_getter,
    fallback_sequences,
)
from flashrl.model.kv_scales import KVScaleState
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.vllm_backend.config import ADDITIONAL_CONFIG_KEY

logger = logging.getLogger(__name__)

STATIC_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
"""vLLM KV-cache dtypes with static per-layer e4m3 scales (the ones flashrl calibrates)."""


class KVScaleSync:
    """Keeps the FP8 KV scales of `llm` calibrated. ``mode`` is None when the engine has no static
    fp8 KV cache (nothing to do), ``"calibrated"`` or a float.

    `kv_scale` overrides what ``engine_kwargs`` recorded in ``additional_config`` (default for an fp8
    cache built another way: ``"calibrated"``).
    """

    def __init__(self, llm: Any, kv_scale: str | float | None = None) -> None:
        vllm_config = llm.llm_engine.vllm_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        additional = (
            vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        )
        self.llm = llm
        self.mode: str | float | None = None
        if cache_dtype in STATIC_FP8_CACHE_DTYPES:
            self.mode = _check_mode(
                kv_scale
                if kv_scale is not None
                else additional.get(ADDITIONAL_CONFIG_KEY, "calibrated")
            )
        elif kv_scale is not None:
            raise ConfigError(
                f"kv_scale={kv_scale!r} needs an engine with kv_cache_dtype='fp8'; this one has "
                f"kv_cache_dtype={cache_dtype!r} (build it with engine_kwargs(...) of an fp8-KV config)"
            )
        self.state = KVScaleState(
            "fp8" if self.mode is not None else "bf16",
            self.mode if self.mode is not None else "calibrated",
            "layer" if self.mode is not None else None,
        )
        """The lifecycle shared with the built-in engine: calibration set, scales, counters."""
        model_config = vllm_config.model_config
        self.model_dir = Path(model_config.model)
        self.dtype = model_config.dtype
        quant = vllm_config.quant_config
        self.scheme = getattr(quant, "scheme_name", "") or "bf16"
        self.skip = tuple(getattr(quant, "skip", DEFAULT_SKIP))
        self.config = (
            ModelConfig.from_dict(model_config.hf_config.to_dict(), source=str(self.model_dir))
            if self.calibrated
            else None
        )
        self.from_fallback = False
        """True while the scales come from random token ids (no real sequence seen yet)."""
        self.load_format = str(vllm_config.load_config.load_format)

    @property
    def calibrated(self) -> bool:
        return self.state.calibrated

    @property
    def recent(self) -> RecentSequences:
        """The calibration set: the most recent rollouts."""
        return self.state.recent

    @property
    def scales(self) -> KVScales | None:
        """The last calibrated scales (None before the first calibration or when not calibrated)."""
        return self.state.scales

    def remember(self, sequences: Sequence[Sequence[int]]) -> None:
        """Add recent token sequences (prompt + response, most important first) to the calibration set."""
        self.state.remember(sequences)

    def check_update(self, names: Sequence[str]) -> None:
        """Raise before anything is sent when an update lacks tensors the calibration needs."""
        if not self.calibrated:
            return
        missing = sorted(set(calibration_tensor_names(self.config)) - set(names))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise WeightError(
                f"this update lacks {', '.join(missing[:5])}{more}: calibrated fp8 KV scales are computed from the new "
                "weights (vLLM resets them on every reload), so send every decoder parameter and the embedding, "
                "or use a fixed kv_scale"
            )

    def start(self) -> float:
        """Set the scales for the weights the engine loaded; returns seconds."""
        if self.mode is None:
            return 0.0
        if self.calibrated and self.load_format == "dummy":
            logger.info(
                "load_format='dummy': fp8 KV scales stay at 1.0 until the first WeightUpdater.update_weights"
            )
            return 0.0
        return self.apply(checkpoint_getter(self.model_dir) if self.calibrated else None)

    def apply(
        self,
        get_tensor: Callable[[str], torch.Tensor] | None,
        device: torch.device | str | None = None,
        sequences: Sequence[Sequence[int]] | None = None,
    ) -> float:
        """Calibrate from `get_tensor` (mode ``calibrated``) or take the fixed value, then set the
        scales on every worker. Returns seconds (0.0 without an fp8 cache)."""
        if self.mode is None:
            return 0.0
        start = time.perf_counter()
        if self.calibrated:
            if get_tensor is None:
                raise ConfigError("calibrated fp8 KV scales need the weights (get_tensor)")
            seqs = list(sequences) if sequences else self.recent.sequences()
            self.from_fallback = not seqs
            if not seqs:
                seqs = fallback_sequences(self.config.vocab_size)
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.state.weights_changed()
            scales = calibrate_from_weights(
                get_tensor,
                self.config,
                seqs,
                self.scheme,
                self.skip,
                self.dtype,
                device,
                include_q=True,
            )
            k, v, q = scales.k[:, 0].tolist(), scales.v[:, 0].tolist(), scales.q.tolist()
            counts = self.llm.collective_rpc("flashrl_set_kv_scales", args=(k, v, q))
            if any(c != self.config.num_layers for c in counts):
                raise RuntimeError(
                    f"set KV scales on {counts} attention layers per worker; the model has "
                    f"{self.config.num_layers}"
                )
            return self.state.record(scales, time.perf_counter() - start)
        self.llm.collective_rpc(
            "flashrl_set_kv_scales", args=(float(self.mode), float(self.mode), None)
        )
        return time.perf_counter() - start

    def summary(self) -> dict[str, float]:
        """The scales' summary and the calibration counters (`KVScaleState.stats`)."""
        scales = self.scales.summary() if self.scales is not None else {}
        return {**scales, **self.state.stats()} if self.calibrated else scales


def _check_mode(value: Any) -> str | float:
    if value == "calibrated":
        return value
    if value == "dynamic":
        raise ValueError(
            "kv_scale='dynamic' uses vLLM's fp8_per_token_head cache (no static scales); build the engine "
            "with engine_kwargs(...) of that config instead of kv_cache_dtype='fp8'"
        )
    try:
        scale = float(value)
    except (TypeError, ValueError):
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise ConfigError(f"kv_scale={value!r} is invalid; allowed: calibrated or a positive float")
    return scale


def set_attention_kv_scales(
    model: torch.nn.Module,
    k_scales: Sequence[float] | float,
    v_scales: Sequence[float] | float,
    q_scales: Sequence[float] | float | None = None,
) -> int:
    """Write scales (one per decoder layer, or one float for all) into every vLLM ``Attention``
    module of `model` in place (device tensors and their host copies); returns how many layers were
    set. None leaves that scale alone."""
    layers = attention_layers(model)
    for index, attn in layers:
        for name, values in (("k", k_scales), ("v", v_scales), ("q", q_scales)):
            if values is None:
                continue
            value = float(values) if isinstance(values, (int, float)) else float(values[index])
            if not value > 0 or value == float("inf"):
                raise InputError(
                    f"{name}_scale of layer {index} must be finite and positive, got {value}"
                )
            value = float(
                torch.tensor(value, dtype=torch.float32)
            )  # host copy == the fp32 device scale
            getattr(attn, f"_{name}_scale").fill_(value)
            setattr(attn, f"_{name}_scale_float", value)
            host = getattr(attn, f"_{name}_scale_cpu", None)
            if isinstance(host, torch.Tensor):
                host.fill_(value)
        # FlashInfer's impl folds the host floats into bmm1/bmm2 scale factors on its first forward
        # and keeps them; forget them so the next forward folds the new scales.
        for cached in ("bmm1_scale", "bmm2_scale"):
            if getattr(attn.impl, cached, None) is not None:
                setattr(attn.impl, cached, None)
    return len(layers)


def attention_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, vLLM ``Attention`` module) pairs, in layer order."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    found = [
        (extract_layer_index(name), module)
        for name, module in model.named_modules()
        if isinstance(module, Attention)
    ]
    return sorted(found, key=lambda pair: pair[0])
