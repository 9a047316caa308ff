"""Online quantization of rollout weights: schemes as data, reference primitives, scaled GEMMs, QuantLinear."""

from flashrl.quant.linear import DEFAULT_SKIP, QuantLinear, QuantReport, quantize_
from flashrl.quant.schemes import SCHEMES, QuantScheme, get_scheme

__all__ = [
    "DEFAULT_SKIP",
    "SCHEMES",
    "QuantLinear",
    "QuantReport",
    "QuantScheme",
    "get_scheme",
    "quantize_",
]
