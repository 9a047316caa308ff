"""flashrl's vLLM quantization configs, one per scheme (``flashrl_int8``, ``flashrl_fp8``,
``flashrl_fp8_channel``, ``flashrl_fp8_block``, ``flashrl_int8_g128``, ``flashrl_int8_g64``): which
method each layer gets. Linear layers get
`FlashRLLinearMethod` (`flashrl.vllm_backend.quant_methods`), skipped linears and routers the
high-precision `FlashRLDenseLinearMethod`, embeddings `FlashRLEmbeddingMethod`, routed experts
`FlashRLFusedMoEMethod`. The plugin (`flashrl.vllm_backend.plugin`) registers `CONFIG_CLASSES`.

vLLM makes one config per engine, so the config is where the engine's `ModelState` is made: every
method it returns shares it (`flashrl.vllm_backend.model_state`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from flashrl.errors import ConfigError
from flashrl.quant.linear import DEFAULT_SKIP, matches_any
from flashrl.vllm_backend.dense_methods import FlashRLDenseLinearMethod, FlashRLEmbeddingMethod
from flashrl.vllm_backend.model_state import ModelState
from flashrl.vllm_backend.moe_methods import FlashRLFusedMoEMethod, is_router
from flashrl.vllm_backend.names import METHOD_NAMES
from flashrl.vllm_backend.quant_methods import FlashRLLinearMethod


class FlashRLQuantConfig(QuantizationConfig):
    """Online quantization of every `LinearBase` layer with one flashrl scheme.

    ``skip`` holds module-name patterns kept in high precision (globs or ``re:`` regexes, as for
    `flashrl.quant.quantize_`), matched against the checkpoint names of the tensors a vLLM layer
    fuses (``...q_proj``, ``...k_proj``, ``...v_proj`` for ``...qkv_proj``). A fused layer is
    skipped when all of its parts match; a pattern that matches only some parts is an error.

    ``smooth`` (a number in (0, 1], or None) turns on online smoothing of the quantized linear
    layers with that exponent (`flashrl.vllm_backend.smoothing`); MoE experts are not smoothed, so a
    model with quantized experts is refused.
    """

    scheme_name: ClassVar[str] = ""
    min_capability: ClassVar[int] = 89

    def __init__(
        self, skip: tuple[str, ...] | list[str] = DEFAULT_SKIP, smooth: float | None = None
    ) -> None:
        super().__init__()
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise ValueError(f"skip must be a list of module-name patterns, got {skip!r}")
        if smooth is not None and (
            isinstance(smooth, bool) or not isinstance(smooth, int | float) or not 0 < smooth <= 1
        ):
            raise ConfigError(
                f"smooth={smooth!r} in the {self.method_name()} quantization_config is invalid; "
                "allowed: a number in (0, 1], or null"
            )
        self.skip = tuple(skip)
        self.smooth = None if smooth is None else float(smooth)
        self.state = ModelState()
        """Shared by every method this config makes: one model's counters and staged layers."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(skip={list(self.skip)}, smooth={self.smooth})"

    @classmethod
    def method_name(cls) -> str:
        return METHOD_NAMES[cls.scheme_name]

    def get_name(self) -> str:
        return self.method_name()

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return cls.min_capability

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FlashRLQuantConfig:
        """From a ``quantization_config`` mapping such as ``{"quant_method": "flashrl_int8", "skip": [...]}``."""
        method = config.get("quant_method", cls.method_name())
        if method != cls.method_name():
            raise ValueError(
                f"{cls.__name__} got quant_method={method!r}; expected {cls.method_name()!r}"
            )
        unknown = sorted(set(config) - {"quant_method", "skip", "smooth"})
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(unknown)} in the {method} quantization_config; "
                "allowed: skip, smooth"
            )
        return cls(skip=config.get("skip", DEFAULT_SKIP), smooth=config.get("smooth"))

    def is_skipped(self, prefix: str) -> bool:
        """Whether the layer named `prefix` stays in high precision (see the class docstring)."""
        if matches_any(prefix, self.skip):
            return True
        parent, _, leaf = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(leaf)
        if not parts:
            return False
        names = [f"{parent}.{part}" if parent else part for part in parts]
        matched = [matches_any(name, self.skip) for name in names]
        if all(matched):
            return True
        if any(matched):
            raise ValueError(
                f"skip patterns {list(self.skip)} match only "
                f"{[n for n, m in zip(names, matched) if m]} of the tensors vLLM fuses into {prefix} "
                f"({', '.join(parts)}); they run as one GEMM, so skip all of them or none"
            )
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            if self.is_skipped(prefix) or is_router(layer, prefix):
                return FlashRLDenseLinearMethod(state=self.state)
            return FlashRLLinearMethod(self.scheme_name, self.smooth, state=self.state)
        if isinstance(layer, VocabParallelEmbedding):
            return FlashRLEmbeddingMethod(state=self.state)
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts) and not matches_any(prefix, self.skip):
            if self.smooth is not None:
                raise ConfigError(
                    f"smooth={self.smooth:g} is not supported for MoE experts ({prefix}): experts are "
                    "not smoothed (as in the built-in engine); drop smooth, or keep the experts in "
                    'high precision with skip: ["*.experts"]'
                )
            return FlashRLFusedMoEMethod(layer.moe_config, self.scheme_name, state=self.state)
        # Attention (no KV-cache scales) and skipped experts: vLLM's unquantized path.
        return None


class FlashRLInt8Config(FlashRLQuantConfig):
    """``flashrl_int8``: W8A8 int8, per-channel weights, per-token dynamic activations."""

    scheme_name = "int8"
    min_capability = 75


class FlashRLFp8Config(FlashRLQuantConfig):
    """``flashrl_fp8``: e4m3, one weight scale per checkpoint tensor, per-tensor dynamic activations."""

    scheme_name = "fp8"


class FlashRLFp8ChannelConfig(FlashRLQuantConfig):
    """``flashrl_fp8_channel``: e4m3, per-channel weights, per-token dynamic activations."""

    scheme_name = "fp8_channel"


class FlashRLFp8BlockConfig(FlashRLQuantConfig):
    """``flashrl_fp8_block``: e4m3, 128x128 weight blocks, 1x128 activation groups (reference GEMM)."""

    scheme_name = "fp8_block"


class FlashRLInt8G128Config(FlashRLQuantConfig):
    """``flashrl_int8_g128``: int8 per-channel weights, int8 activations with one scale per token and
    group of 128 columns (flashrl's reference GEMM: vLLM has no kernel for group activation scales)."""

    scheme_name = "int8_g128"
    min_capability = 75


class FlashRLInt8G64Config(FlashRLQuantConfig):
    """``flashrl_int8_g64``: as ``flashrl_int8_g128`` with groups of 64 columns."""

    scheme_name = "int8_g64"
    min_capability = 75


CONFIG_CLASSES: tuple[type[FlashRLQuantConfig], ...] = (
    FlashRLInt8Config,
    FlashRLFp8Config,
    FlashRLFp8ChannelConfig,
    FlashRLFp8BlockConfig,
    FlashRLInt8G128Config,
    FlashRLInt8G64Config,
)
