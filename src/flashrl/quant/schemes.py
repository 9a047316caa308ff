"""Quantization schemes as data.

A scheme says *what* is quantized and at which granularity; the code in `primitives`, `gemm` and
`linear` reads these fields instead of branching on scheme names. Formulas: shared/reference/numerics.md
section 3. One convention everywhere: a scale is the dequantization multiplier, ``x ~= q * s`` with
``s = max(amax, eps) / qmax``.

| name          | weight codes      | weight scale            | activation scale (dynamic)     |
|---------------|-------------------|-------------------------|--------------------------------|
| `bf16`        | none              | none                    | none                           |
| `int8`        | int8, [-127, 127] | per output channel [N,1]| per token [M,1]                |
| `fp8`         | float8_e4m3fn     | per tensor              | per tensor                     |
| `fp8_channel` | float8_e4m3fn     | per output channel [N,1]| per token [M,1]                |
| `fp8_block`   | float8_e4m3fn     | per 128x128 block       | per 1x128 group                |
| `int8_g128`   | int8, [-127, 127] | per output channel [N,1]| per 1x128 group                |
| `int8_g64`    | int8, [-127, 127] | per output channel [N,1]| per 1x64 group                 |

The `int8_g*` schemes keep int8's weights and give each token one activation scale per group of
columns instead of one per row: on SmolLM2-135M the activations cause most of int8's mismatch (int8
weights alone: KL 0.005; per-token activations: 0.066; groups of 64: 0.011; benchmarks/RESULTS.md).
Their GEMM multiplies the dequantized activation groups by the weight codes in fp32 (no integer
kernel takes per-group scales), so on a GPU they are a reference path, not a fast one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flashrl.errors import ConfigError

WeightGranularity = Literal["tensor", "channel", "block"]
ActivationGranularity = Literal["tensor", "token", "group"]

INT8_QMAX = 127.0
FP8_E4M3_QMAX = 448.0
AMAX_EPS = 1e-10
"""Floor on amax before dividing by qmax: an all-zero row, block or padding gives finite scales."""


@dataclass(frozen=True)
class QuantScheme:
    """One rollout quantization scheme (numerics.md section 3)."""

    name: str
    code_dtype: torch.dtype | None
    """Storage dtype of weight and activation codes; None means no quantization (bf16)."""
    weight_granularity: WeightGranularity | None = None
    activation_granularity: ActivationGranularity | None = None
    block_size: tuple[int, int] = (128, 128)
    """Weight block [rows, cols] for `block` granularity; the activation group is block_size[1]
    (for per-channel weights with `group` activations only block_size[1] means anything)."""

    @property
    def is_quantized(self) -> bool:
        return self.code_dtype is not None

    @property
    def qmax(self) -> float:
        if self.code_dtype == torch.int8:
            return INT8_QMAX
        if self.code_dtype == torch.float8_e4m3fn:
            return FP8_E4M3_QMAX
        raise ValueError(f"scheme {self.name!r} has no quantized range")

    @property
    def group_size(self) -> int:
        return self.block_size[1]


SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in (
        QuantScheme("bf16", None),
        QuantScheme("int8", torch.int8, "channel", "token"),
        QuantScheme("fp8", torch.float8_e4m3fn, "tensor", "tensor"),
        QuantScheme("fp8_channel", torch.float8_e4m3fn, "channel", "token"),
        QuantScheme("fp8_block", torch.float8_e4m3fn, "block", "group"),
        QuantScheme("int8_g128", torch.int8, "channel", "group", (1, 128)),
        QuantScheme("int8_g64", torch.int8, "channel", "group", (1, 64)),
    )
}


def get_scheme(scheme: str | QuantScheme) -> QuantScheme:
    """Return the scheme named `scheme` (a `QuantScheme` passes through).

    Raises `ConfigError` (a ValueError) naming the allowed schemes when the name is unknown.
    """
    if isinstance(scheme, QuantScheme):
        return scheme
    if not isinstance(scheme, str) or scheme.strip().lower() not in SCHEMES:
        raise ConfigError(f"unknown quantization scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    return SCHEMES[scheme.strip().lower()]


def parse_scheme_list(text: str) -> list[QuantScheme]:
    """Parse a comma-separated list such as ``"bf16,int8,fp8"`` (CLI flags)."""
    names = [part for part in (p.strip() for p in text.split(",")) if part]
    if not names:
        raise ConfigError(f"empty scheme list {text!r}; allowed: {', '.join(SCHEMES)}")
    return [get_scheme(name) for name in names]
