"""Scaled matrix multiplication for each scheme: ``Y = X W^T`` with quantized X and W.

| scheme        | op                                   | epilogue                                      |
|---------------|--------------------------------------|-----------------------------------------------|
| `int8`        | `torch._int_mm` on CUDA; exact fp32 chunks on CPU (below) | fp32 ``acc * s_x * s_w^T (+ bias)``, then cast |
| `fp8`         | `torch._scaled_mm`, tensorwise       | inside the op; bias added after in out dtype  |
| `fp8_channel` | `torch._scaled_mm`, rowwise          | inside the op; bias added after in out dtype  |
| `fp8_block`   | reference path: dequantize per 128x128 block / 1x128 group, fp32 matmul |  |
| `int8_g128/64`| dequantized 1xg activation groups times the int8 weight codes, fp32 matmul | ``* s_w^T (+ bias)``, then cast |

`torch._int_mm` and `torch._scaled_mm` (tensorwise and rowwise) run on the CPU build of torch 2.13,
so the fast paths are what the CPU tests exercise. CUDA shape rules (numerics.md section 5):
`_int_mm` needs M > 16 and K, N multiples of 8; we pad M with zero rows and slice the result back.
`_scaled_mm` needs K and N multiples of 16, which `check_gemm_shape` enforces at layer creation.
The blockwise CUDA kernels are not wired in yet: on every device `fp8_block` runs the reference path
(correct, quantized numerics, but no speed-up); this is logged once on CUDA, never silent.

On the CPU, `int8_mm` computes the same int32 result with fp32 matmuls over chunks of at most
1024 columns of K: each product of two int8 codes is at most 2^14 in magnitude, so every partial
sum of a chunk is an integer of magnitude at most 2^24, which fp32 represents exactly, and the
chunks add in int32. The result is bit-identical to `torch._int_mm` (tested), and on CPUs without
int8 dot-product units it is 10-30x faster (torch's CPU `_int_mm` on a 2-core AMD EPYC: 31 ms for
a 64x576x1536 product, against 3.3 ms; benchmarks/RESULTS.md). CPUs with AMX int8 tiles keep
`torch._int_mm` (oneDNN's AMX kernels).

Activations are quantized by `primitives.quantize_activation`, which runs the fused Triton kernels of
`flashrl.quant.kernels` on CUDA (bit-identical to the torch reference; ``FLASHRL_QUANT_KERNELS``
switches, see docs/kernels.md) and the torch reference elsewhere.
"""

from __future__ import annotations

import logging

import torch

from flashrl.errors import UnsupportedError
from flashrl.quant.primitives import (
    dequantize_per_block_shards,
    dequantize_per_group,
    quantize_activation,
)
from flashrl.quant.schemes import QuantScheme

logger = logging.getLogger(__name__)

INT_MM_MIN_ROWS_CUDA = 17
EXACT_FP32_CHUNK = 1024
"""Columns of K per fp32 matmul in the CPU int8 path: 1024 * 128 * 128 = 2^24, the largest integer
range fp32 holds exactly (codes are in [-128, 127])."""
_warned_reference: set[str] = set()
_cpu_rowwise: bool | None = None


def cpu_has_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `torch._scaled_mm` takes rowwise scales (torch 2.13 does; 2.11 only
    takes one scale per operand). Probed once; without it the CPU fp8 path multiplies the fp8 codes
    as fp32 (every product of two e4m3 values is exact in fp32; only the summation order differs),
    and says so once at INFO."""
    global _cpu_rowwise
    if _cpu_rowwise is None:
        a = torch.ones(2, 16).to(torch.float8_e4m3fn)
        try:
            torch._scaled_mm(a, a.t(), torch.ones(2, 1), torch.ones(1, 2), out_dtype=torch.float32)
            _cpu_rowwise = True
        except (RuntimeError, NotImplementedError):
            _cpu_rowwise = False
            logger.info(
                "torch %s: CPU _scaled_mm has no rowwise scales; CPU fp8 GEMMs run as fp32 "
                "matmuls of the fp8 codes (same products, another summation order)",
                torch.__version__,
            )
    return _cpu_rowwise


def check_gemm_shape(
    scheme: QuantScheme, in_features: int, out_features: int, device: torch.device
) -> None:
    """Raise when a layer shape cannot run on `device`'s kernels for `scheme` (CUDA constraints)."""
    if device.type != "cuda" or not scheme.is_quantized:
        return
    multiple = 8 if scheme.code_dtype == torch.int8 else 16
    if in_features % multiple or out_features % multiple:
        raise UnsupportedError(
            f"scheme {scheme.name!r} on CUDA needs in_features and out_features divisible by {multiple}, "
            f"got [{out_features}, {in_features}]; keep this layer in bf16 with skip=..."
        )


def pad_rows(x: torch.Tensor, min_rows: int) -> torch.Tensor:
    """Append zero rows so that `x` has at least `min_rows` rows (no copy when it already has)."""
    if x.shape[0] >= min_rows:
        return x
    return torch.cat([x, x.new_zeros(min_rows - x.shape[0], x.shape[1])])


def int8_mm(xq: torch.Tensor, wq: torch.Tensor, min_rows: int | None = None) -> torch.Tensor:
    """Exact int32 ``xq @ wq^T`` via `torch._int_mm`; `wq` is [N, K] as nn.Linear stores it.

    `min_rows` pads M with zero rows (default: 17 on CUDA, where `_int_mm` needs M > 16; none on CPU).
    """
    m = xq.shape[0]
    if xq.device.type == "cpu" and min_rows is None and not CPU_HAS_AMX_INT8:
        return int8_mm_exact_fp32(xq, wq)
    if min_rows is None:
        min_rows = INT_MM_MIN_ROWS_CUDA if xq.is_cuda else 0
    acc = torch._int_mm(pad_rows(xq, min_rows), wq.t())
    return acc[:m]


def cpu_has_amx_int8() -> bool:
    """Whether this CPU reports AMX int8 tiles (Linux /proc/cpuinfo), where torch's `_int_mm`
    runs oneDNN's AMX kernels and is the faster CPU path; elsewhere the fp32 chunks are."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return any(line.startswith("flags") and "amx_int8" in line.split() for line in f)
    except OSError:
        return False


CPU_HAS_AMX_INT8 = cpu_has_amx_int8()
"""Read once at import (a traced decode step must not open files)."""


def int8_mm_exact_fp32(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``xq @ wq^T`` from fp32 matmuls over K chunks of `EXACT_FP32_CHUNK` columns
    (every partial sum is an integer fp32 represents exactly; see the module doc)."""
    x, w = xq.to(torch.float32), wq.to(torch.float32)
    k = x.shape[1]
    acc = torch.mm(x[:, :EXACT_FP32_CHUNK], w[:, :EXACT_FP32_CHUNK].t()).to(torch.int32)
    for start in range(EXACT_FP32_CHUNK, k, EXACT_FP32_CHUNK):
        end = start + EXACT_FP32_CHUNK
        acc += torch.mm(x[:, start:end], w[:, start:end].t()).to(torch.int32)
    return acc


def int8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W8A8 int8: dynamic int8 activations, per-channel weights [N,1]. Per-token activation scales
    take the exact int32 accumulation; per-group scales (`int8_g*`) are applied to the activation
    codes first (``Y = sum_g s_x[m,g] (Xq_g . Wq_g) s_w[n]``, summed in fp32 in another order)."""
    xq, x_scale = quantize_activation(x, scheme)
    if scheme.activation_granularity == "group":
        _warn_reference_once(x, scheme)
        x_deq = dequantize_per_group(xq, x_scale, scheme.group_size)
        y = torch.mm(x_deq, wq.to(torch.float32).t()).mul_(w_scale.reshape(1, -1))
    else:
        acc = int8_mm(xq, wq)
        y = acc.to(torch.float32).mul_(x_scale).mul_(w_scale.reshape(1, -1))
    if bias is not None:
        y.add_(bias.to(torch.float32))
    return y.to(out_dtype or x.dtype)


def cublas_aligned(scale: torch.Tensor) -> torch.Tensor:
    """`scale`, copied if its data does not start on a 16-byte boundary. cuBLASLt's fp8 GEMM
    refuses such scales (CUBLAS_STATUS_NOT_SUPPORTED, seen on H100 and H200; pytorch#159957), and
    a scale sliced from a larger tensor (one expert's, some tokens') can start anywhere. Not checked
    while torch.compile traces (fake tensors have no address; its graphs hold whole tensors)."""
    if torch.compiler.is_compiling() or scale.data_ptr() % 16 == 0:
        return scale
    return scale.clone()


def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """FP8 e4m3 with tensorwise (one scale each) or rowwise (``[M,1]`` x ``[1,N]``) `torch._scaled_mm`.

    A per-tensor activation scale meets a multi-scale weight (a fused layer with one scale per
    checkpoint tensor) as a broadcast rowwise call. On CPU, per-tensor scales also go through the
    rowwise kernel with broadcast scales (the same products): torch 2.13's CPU tensorwise kernel is
    about 70x slower than its rowwise one.
    """
    out_dtype = out_dtype or x.dtype
    xq, x_scale = quantize_activation(x, scheme)
    if w_scale.numel() == 1 and x_scale.numel() == 1 and x.is_cuda:
        x_scale, w_scale = cublas_aligned(x_scale.reshape(())), cublas_aligned(w_scale.reshape(()))
        y = torch._scaled_mm(xq, wq.t(), x_scale, w_scale, out_dtype=out_dtype)
    else:
        y = fp8_rowwise_mm(xq, x_scale, wq, w_scale, out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y


def fp8_block_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    shard_sizes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Reference blockwise FP8: 1x128 activation groups and 128x128 weight blocks dequantized to fp32.

    Mathematically ``Y[m,n] = sum_g s_x[m,g] s_w[n//128,g] (Xq_g . Wq_g)``; the fp32 matmul sums the
    same products in a different order. `shard_sizes` describes a fused weight whose row shards each
    have their own block grid (stacked along the scale's first dim).
    """
    _warn_reference_once(x, scheme)
    xq, x_scale = quantize_activation(x, scheme)
    x_deq = dequantize_per_group(xq, x_scale, scheme.group_size)
    w_deq = dequantize_per_block_shards(wq, w_scale, scheme.block_size, shard_sizes)
    y = x_deq @ w_deq.t()
    if bias is not None:
        y.add_(bias.to(torch.float32))
    return y.to(out_dtype or x.dtype)


def _warn_reference_once(x: torch.Tensor, scheme: QuantScheme) -> None:
    """Say once per scheme that a CUDA GEMM runs the reference (dequantize + matmul) path."""
    if x.is_cuda and scheme.name not in _warned_reference:
        logger.warning(
            "%s runs the reference (dequantize + matmul) path on CUDA: correct but not fast",
            scheme.name,
        )
        _warned_reference.add(scheme.name)


def scaled_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: QuantScheme,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    shard_sizes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a quantized weight; `x` may have any leading dims.

    `w_scale` is laid out as `quantize_weight` returns it, except for a per-tensor scheme over a
    fused weight, where it is one scale per output row (see `QuantLinear`). `shard_sizes` matters
    only for blocks (one block grid per shard).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if scheme.code_dtype == torch.int8:
        y = int8_linear(x2, wq, w_scale, scheme, bias, out_dtype)
    elif scheme.weight_granularity == "block":
        y = fp8_block_linear(x2, wq, w_scale, scheme, bias, out_dtype, shard_sizes)
    else:
        y = fp8_linear(x2, wq, w_scale, scheme, bias, out_dtype)
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
    are row-local). The same ops as `int8_linear` / `fp8_linear` after their quantization, so the
    result is bit-identical; MoE experts quantize their inputs once for all experts this way."""
    if scheme.activation_granularity != "token":
        raise ValueError(f"scheme {scheme.name!r} has no per-token activation scales")
    if scheme.code_dtype == torch.int8:
        acc = int8_mm(xq, wq)
        return acc.to(torch.float32).mul_(x_scale).mul_(w_scale.reshape(1, -1)).to(out_dtype)
    return fp8_rowwise_mm(xq, x_scale, wq, w_scale, out_dtype)


def fp8_rowwise_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(xq @ wq^T) * s_x * s_w^T`` through `torch._scaled_mm` with rowwise scales ``[M,1] x [1,N]``
    (a single scale is broadcast). On a CPU torch without rowwise scales (`cpu_has_rowwise_scaled_mm`)
    an fp32 matmul of the codes: the same exact products in another summation order."""
    scale_a = cublas_aligned(x_scale.reshape(-1, 1).expand(xq.shape[0], 1).contiguous())
    scale_b = cublas_aligned(w_scale.reshape(1, -1).expand(1, wq.shape[0]).contiguous())
    if xq.is_cuda or cpu_has_rowwise_scaled_mm():
        return torch._scaled_mm(xq, wq.t(), scale_a, scale_b, out_dtype=out_dtype)
    return (xq.float() @ wq.float().t()).mul_(scale_a).mul_(scale_b).to(out_dtype)
