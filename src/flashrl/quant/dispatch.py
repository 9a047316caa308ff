"""Which function runs: the quantizer and the GEMM of every scheme, on every device, in two tables.

- `QUANTIZERS` maps (granularity, backend) to the function that turns a high-precision tensor into
  codes and scales. The backend is ``triton`` (the fused kernels, `flashrl.quant.kernels.launch`)
  or ``torch`` (the reference, `flashrl.quant.primitives`); both give the same bits.
  `flashrl.quant.kernels.use_triton` picks it: Triton for CUDA tensors when it is installed,
  the torch reference elsewhere, unless ``FLASHRL_QUANT_KERNELS`` says otherwise (docs/kernels.md).
  A scheme's weight granularity (`quantize_weight`: ``tensor``, ``channel`` -> ``row``,
  ``block``) and activation granularity (`quantize_activation`: ``tensor``, ``token`` -> ``row``,
  ``group``) name the row.
- `GEMMS` maps (gemm kind, device) to the scaled GEMM (`flashrl.quant.gemm`). The kind follows
  from the scheme and, for fp8 per tensor, the shape class of the scales (`gemm_kind`); the device
  is ``cuda`` or ``cpu`` (any other device takes the CPU functions).

| scheme        | quantizer (weight / activation)  | GEMM on cuda                  | GEMM on cpu          |
|---------------|----------------------------------|-------------------------------|----------------------|
| `int8`        | row / row                        | `int8_rowwise_cuda`           | `int8_rowwise_cpu`   |
| `int8_g*`     | row / group                      | `int8_group_cuda`: Triton `int8_group_triton` when `use_triton`, else `int8_group` (reference) | `int8_group` |
| `fp8`         | tensor / tensor                  | `fp8_tensorwise_cuda`; fused layers (one scale per row) `fp8_rowwise_cuda` | `fp8_rowwise_cpu` |
| `fp8_channel` | row / row                        | `fp8_rowwise_cuda`            | `fp8_rowwise_cpu`    |
| `fp8_block`   | block / group                    | `fp8_block` (reference)       | `fp8_block`          |

`scaled_linear` is the one entry point of a quantized layer's forward (`QuantLinear`,
`QuantExperts`, the vLLM backend): quantize the activations, look up the GEMM, run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from flashrl.errors import InputError
from flashrl.quant import gemm, primitives
from flashrl.quant.cpu_mirror import Fp32Mirror
from flashrl.quant.encode import check_float_input
from flashrl.quant.gemm import GemmArgs
from flashrl.quant.kernels import launch, use_triton
from flashrl.quant.schemes import QuantScheme

Backend = Literal["torch", "triton"]
Device = Literal["cuda", "cpu"]
GemmKind = Literal["int8_rowwise", "int8_group", "fp8_tensorwise", "fp8_rowwise", "fp8_block"]
Quantizer = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Gemm = Callable[[GemmArgs], torch.Tensor]

QUANTIZERS: dict[tuple[str, Backend], Quantizer] = {
    ("tensor", "torch"): primitives.quantize_per_tensor,
    ("tensor", "triton"): launch.quantize_per_tensor,
    ("row", "torch"): primitives.quantize_per_row,
    ("row", "triton"): launch.quantize_per_row,
    ("block", "torch"): primitives.quantize_per_block,
    ("block", "triton"): launch.quantize_per_block,
    ("group", "torch"): primitives.quantize_per_group,
    ("group", "triton"): launch.quantize_per_group,
}
"""(granularity, backend) -> ``f(x, code_dtype, [block | group,] out, scale_out, check_finite)``."""

GRANULARITY = {
    "tensor": "tensor",
    "channel": "row",
    "token": "row",
    "block": "block",
    "group": "group",
}
"""A scheme's weight or activation granularity -> the quantizer's row of `QUANTIZERS`."""

GEMMS: dict[tuple[GemmKind, Device], Gemm] = {
    ("int8_rowwise", "cuda"): gemm.int8_rowwise_cuda,
    ("int8_rowwise", "cpu"): gemm.int8_rowwise_cpu,
    ("int8_group", "cuda"): gemm.int8_group_cuda,
    ("int8_group", "cpu"): gemm.int8_group,
    ("fp8_tensorwise", "cuda"): gemm.fp8_tensorwise_cuda,
    ("fp8_tensorwise", "cpu"): gemm.fp8_rowwise_cpu,
    ("fp8_rowwise", "cuda"): gemm.fp8_rowwise_cuda,
    ("fp8_rowwise", "cpu"): gemm.fp8_rowwise_cpu,
    ("fp8_block", "cuda"): gemm.fp8_block,
    ("fp8_block", "cpu"): gemm.fp8_block,
}
"""(gemm kind, device) -> ``f(gemm.GemmArgs) -> y``."""


def backend(x: torch.Tensor) -> Backend:
    """The quantizer backend for `x` (`flashrl.quant.kernels.use_triton`: mode and device)."""
    return "triton" if use_triton(x) else "torch"


def device_of(x: torch.Tensor) -> Device:
    """The `GEMMS` device of `x`: ``cuda``, else ``cpu``."""
    return "cuda" if x.is_cuda else "cpu"


def gemm_kind(scheme: QuantScheme, x_scale: torch.Tensor, w_scale: torch.Tensor) -> GemmKind:
    """The GEMM of `scheme` for these scales: fp8 per tensor is tensorwise when both operands have
    one scale, rowwise when the weight has one per row (a fused layer) or the activation per token."""
    if scheme.code_dtype == torch.int8:
        return "int8_group" if scheme.activation_granularity == "group" else "int8_rowwise"
    if scheme.weight_granularity == "block":
        return "fp8_block"
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        return "fp8_tensorwise"
    return "fp8_rowwise"


def _quantize(
    x: torch.Tensor,
    scheme: QuantScheme,
    granularity: str,
    out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    check_finite: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    row = GRANULARITY[granularity]
    size = {"block": (scheme.block_size,), "group": (scheme.group_size,)}.get(row, ())
    quantize = QUANTIZERS[row, backend(x)]
    return quantize(x, scheme.code_dtype, *size, out, scale_out, check_finite)


def quantize_weight(
    w: torch.Tensor,
    scheme: QuantScheme,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight [N, K] with `scheme`'s weight granularity. Returns (codes, scales)."""
    check_float_input(w, name)
    if scheme.weight_granularity not in ("tensor", "channel", "block"):
        raise ValueError(f"scheme {scheme.name!r} does not quantize weights")
    try:
        return _quantize(w, scheme, scheme.weight_granularity, out, scale_out, check_finite)
    except InputError as err:
        raise InputError(f"{name}: {err}") from None


def quantize_activation(
    x: torch.Tensor, scheme: QuantScheme, check_finite: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization of a 2-D input [M, K] with `scheme`'s activation granularity.

    Scales: ``[]`` (tensor), ``[M, 1]`` (token), ``[M, ceil(K/g)]`` (group)."""
    if scheme.activation_granularity not in ("tensor", "token", "group"):
        raise ValueError(f"scheme {scheme.name!r} does not quantize activations")
    return _quantize(x, scheme, scheme.activation_granularity, None, None, check_finite)


def scaled_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    shard_sizes: tuple[int, ...] | None = None,
    mirror: Fp32Mirror | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a quantized weight; `x` may have any leading dims.

    `w_scale` is laid out as `quantize_weight` returns it, except for a per-tensor scheme over a
    fused weight, where it is one scale per output row (`flashrl.quant.granularity`).
    `shard_sizes` matters only for blocks (one block grid per shard); `mirror` is the layer's fp32
    copy of `wq` for the CPU GEMMs (`flashrl.quant.cpu_mirror`).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_activation(x2, scheme)
    run = GEMMS[gemm_kind(scheme, x_scale, w_scale), device_of(x2)]
    out_dtype = out_dtype or x.dtype
    y = run(GemmArgs(xq, x_scale, wq, w_scale, scheme, out_dtype, bias, shard_sizes, mirror))
    return y.reshape(*lead, wq.shape[0])


def prequantized_linear(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: QuantScheme,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x @ W^T`` (no bias) from per-token activation codes and scales [M, 1] that
    `quantize_activation` made for these rows (possibly as part of a larger tensor: per-token codes
    are row-local). The GEMM `scaled_linear` runs after its quantization, always rowwise, so the
    result is bit-identical; MoE experts quantize their inputs once for all experts this way."""
    if scheme.activation_granularity != "token":
        raise ValueError(f"scheme {scheme.name!r} has no per-token activation scales")
    kind: GemmKind = "int8_rowwise" if scheme.code_dtype == torch.int8 else "fp8_rowwise"
    return GEMMS[kind, device_of(xq)](GemmArgs(xq, x_scale, wq, w_scale, scheme, out_dtype))
