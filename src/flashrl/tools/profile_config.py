"""`ProfileConfig`: the arguments of `flashrl profile` (`flashrl.tools.profile.run_profile`), checked
before any model is loaded."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flashrl.core.config import KV_CACHE_DTYPES
from flashrl.core.device import DTYPES
from flashrl.errors import ConfigError
from flashrl.quant.schemes import SCHEMES, parse_scheme_list
from flashrl.tools.calibration_prompts import read_prompts_file

DEFAULT_THRESHOLD = 0.1
"""Relative output error above which a layer is recommended to stay in bf16 (the reasoning is in
`flashrl.tools.profile`'s module doc)."""


@dataclass
class ProfileConfig:
    """Arguments of `run_profile` (the flags of `flashrl profile`)."""

    model: str
    """Hugging Face checkpoint directory (bf16/fp32 safetensors)."""
    quant: str | Sequence[str] = "int8"
    """Schemes to profile, comma-separated (bf16 is always the reference)."""
    prompts: str | None = None
    """Calibration prompts: .txt (one per line) or .jsonl (strings or {"prompt": ...}); default:
    the built-in set (seeded random token ids for a model without a tokenizer)."""
    kv_cache_dtype: str = "bf16"
    """Also quantize the KV cache (fp8) and report its share of the mismatch."""
    threshold: float = DEFAULT_THRESHOLD
    """Relative output error above which a layer is kept in bf16."""
    max_prompt_tokens: int = 128
    """Prompts are cut to this many tokens."""
    max_new_tokens: int = 64
    """Sampled response length."""
    device: str | None = None
    """cpu, cuda or cuda:N (default: cuda when available)."""
    dtype: str = "bf16"
    """Activation dtype: bf16, fp16 or fp32."""
    lm_head_fp32: bool = False
    """Profile with the LM head and logits in fp32."""
    seed: int = 0
    temperature: float = 1.0
    """Sampling temperature of the calibration responses."""
    progress: bool = True
    """A progress bar over the profile's stages (stderr)."""
    smooth: float | None = 0.5
    """Online smoothing exponent tried end to end on top of the skip list (`rollout.smooth`);
    recommended only if it lowers the exact KL; null: not tried. Dense models only."""

    def schemes(self) -> list[str]:
        text = self.quant if isinstance(self.quant, str) else ",".join(self.quant)
        names = [s.name for s in parse_scheme_list(text)]
        if "bf16" in names:
            quantized = ", ".join(s for s in SCHEMES if s != "bf16")
            raise ConfigError(
                f"--quant {text!r}: bf16 is the reference every scheme is compared "
                f"with; list quantized schemes only ({quantized})"
            )
        if len(set(names)) != len(names):
            raise ConfigError(f"--quant {text!r} names a scheme twice")
        return names

    def check(self) -> None:
        """ConfigError (InputError for a bad prompts file) before any model is loaded."""
        self.schemes()
        threshold = self.threshold
        if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
            raise ConfigError(
                f"--threshold {threshold!r} is invalid; allowed: a positive number "
                f"(relative output error, default {DEFAULT_THRESHOLD})"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} is invalid; "
                f"allowed: {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
        for name in ("max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0 (responses are sampled)")
        if self.prompts is not None:
            read_prompts_file(self.prompts)  # a bad file fails before any model is loaded
