"""The scaled GEMMs, one function per kernel: ``Y = X W^T`` from quantized activations and weights.

Which one runs for a scheme, a device and a shape is the table `flashrl.quant.dispatch.GEMMS`;
every function here takes one `GemmArgs`, activations already quantized
(`dispatch.quantize_activation`).

| function              | op                                                  | epilogue                              |
|-----------------------|-----------------------------------------------------|---------------------------------------|
| `int8_rowwise_cuda`   | `torch._int_mm`, M padded to 17                     | fp32 ``acc * s_x * s_w^T (+ bias)``, then cast |
| `int8_rowwise_cpu`    | exact fp32 chunks (below); `torch._int_mm` on AMX CPUs | the same                            |
| `int8_group_triton`   | Triton: exact int32 `tl.dot` per group of g, ``* s_x[:, g]`` summed in fp32 (`kernels/group_gemm.py`) | ``* s_w^T (+ bias)`` in fp32, then cast |
| `int8_group`          | reference: dequantized 1xg activation groups times the int8 weight codes, fp32 matmul | ``* s_w^T (+ bias)``, then cast |
| `fp8_tensorwise_cuda` | `torch._scaled_mm`, one scale each                  | inside the op; bias added after in out dtype |
| `fp8_rowwise_cuda`    | `torch._scaled_mm`, rowwise ``[M,1] x [1,N]``       | inside the op; bias added after in out dtype |
| `fp8_rowwise_cpu`     | fp32 matmul of the decoded codes (exact products, another summation order) | fp32 ``* s_x * s_w^T``, cast, bias |
| `fp8_block`           | reference: dequantize per 128x128 block / 1x128 group, fp32 matmul | ``+ bias``, then cast |

`torch._int_mm` runs on the CPU build of torch 2.13 (used on AMX CPUs); `torch._scaled_mm` runs
there too but several times slower than an fp32 matmul of the decoded fp8 codes, which gives the
same products (no CPU has fp8 arithmetic), so the CPU fp8 GEMM is that matmul. CUDA shape rules (numerics.md section 5):
`_int_mm` needs M > 16 and K, N multiples of 8; we pad M with zero rows and slice the result back.
`_scaled_mm` needs K and N multiples of 16, which `check_gemm_shape` enforces at layer creation.
The blockwise CUDA kernels are not wired in yet: on every device `fp8_block` runs the reference path
(correct, quantized numerics, but no speed-up); this is logged once on CUDA, never silent. `int8_g*`
on CUDA runs `int8_group_triton` when `kernels.use_triton` allows (`int8_group_cuda`), else the
reference `int8_group` (logged the same way).

On the CPU, `int8_mm_exact_fp32` computes the int32 product with fp32 matmuls over chunks of at most
1024 columns of K: each product of two int8 codes is at most 2^14 in magnitude, so every partial
sum of a chunk is an integer of magnitude at most 2^24, which fp32 represents exactly, and the
chunks add in int32. The result is bit-identical to `torch._int_mm` (tested), and on CPUs without
int8 dot-product units it is 10-30x faster (torch's CPU `_int_mm` on a 2-core AMD EPYC: 31 ms for
a 64x576x1536 product, against 3.3 ms; benchmarks/RESULTS.md). CPUs with AMX int8 tiles keep
`torch._int_mm` (oneDNN's AMX kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from flashrl.errors import UnsupportedError
from flashrl.quant.cpu_mirror import Fp32Mirror
from flashrl.quant.encode import fp8_to_fp32
from flashrl.quant.kernels import launch, use_triton
from flashrl.quant.primitives import dequantize_per_block_shards, dequantize_per_group
from flashrl.quant.schemes import QuantScheme

logger = logging.getLogger(__name__)

INT_MM_MIN_ROWS_CUDA = 17
EXACT_FP32_CHUNK = 1024
"""Columns of K per fp32 matmul in the CPU int8 path: 1024 * 128 * 128 = 2^24, the largest integer
range fp32 holds exactly (codes are in [-128, 127])."""
_warned_reference: set[str] = set()
"""Schemes already warned about (`_warn_reference_once`): a once-per-process warning about this
machine (no fast CUDA kernel for the scheme), the same for every engine, so module-level."""


class GemmArgs(NamedTuple):
    """What every scaled GEMM takes: activation codes and scales ([M, K], ``[]`` / [M, 1] /
    [M, groups]), weight codes [N, K] and scales (`flashrl.quant.granularity`), and the epilogue."""

    xq: torch.Tensor
    x_scale: torch.Tensor
    wq: torch.Tensor
    w_scale: torch.Tensor
    scheme: QuantScheme
    out_dtype: torch.dtype
    bias: torch.Tensor | None = None
    shard_sizes: tuple[int, ...] | None = None
    """Rows of each shard of a fused weight: blocks have one grid per shard."""
    mirror: Fp32Mirror | None = None
    """The layer's fp32 copy of `wq` for the CPU paths (`flashrl.quant.cpu_mirror`)."""


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


def int_mm(xq: torch.Tensor, wq: torch.Tensor, min_rows: int = 0) -> torch.Tensor:
    """Exact int32 ``xq @ wq^T`` via `torch._int_mm`, M padded with zero rows to `min_rows`
    (CUDA's `_int_mm` needs M > 16); `wq` is [N, K] as nn.Linear stores it."""
    acc = torch._int_mm(pad_rows(xq, min_rows), wq.t())
    return acc[: xq.shape[0]]


def int8_mm_cuda(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """The int32 product of the CUDA int8 GEMM: `torch._int_mm`, M padded to 17."""
    return int_mm(xq, wq, INT_MM_MIN_ROWS_CUDA)


def int8_mm_cpu(
    xq: torch.Tensor, wq: torch.Tensor, mirror: Fp32Mirror | None = None
) -> torch.Tensor:
    """The int32 product of the CPU int8 GEMM: fp32 chunks, or `torch._int_mm` on AMX CPUs."""
    return int_mm(xq, wq) if CPU_HAS_AMX_INT8 else int8_mm_exact_fp32(xq, wq, mirror)


def int8_mm_exact_fp32(
    xq: torch.Tensor, wq: torch.Tensor, mirror: Fp32Mirror | None = None
) -> torch.Tensor:
    """Exact int32 ``xq @ wq^T`` from fp32 matmuls over K chunks of `EXACT_FP32_CHUNK` columns
    (every partial sum is an integer fp32 represents exactly; see the module doc)."""
    x, w = xq.to(torch.float32), codes_fp32(wq, mirror)
    k = x.shape[1]
    acc = torch.mm(x[:, :EXACT_FP32_CHUNK], w[:, :EXACT_FP32_CHUNK].t()).to(torch.int32)
    for start in range(EXACT_FP32_CHUNK, k, EXACT_FP32_CHUNK):
        end = start + EXACT_FP32_CHUNK
        acc += torch.mm(x[:, start:end], w[:, start:end].t()).to(torch.int32)
    return acc


def codes_fp32(q: torch.Tensor, mirror: Fp32Mirror | None = None) -> torch.Tensor:
    """Weight codes as fp32 values (exact for int8 and e4m3), from `mirror` when there is one."""
    convert = fp8_to_fp32 if q.dtype == torch.float8_e4m3fn else _to_fp32
    return convert(q) if mirror is None else mirror.get(q, convert)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def _fp32_epilogue(y: torch.Tensor, a: GemmArgs) -> torch.Tensor:
    """``y * s_w^T (+ bias)`` in fp32 (in place), cast once to the output dtype."""
    y.mul_(a.w_scale.reshape(1, -1))
    if a.bias is not None:
        y.add_(a.bias.to(torch.float32))
    return y.to(a.out_dtype)


def int8_rowwise_cuda(a: GemmArgs) -> torch.Tensor:
    """W8A8 int8 on CUDA, per-token x per-channel scales: exact int32 accumulation, fp32 epilogue."""
    acc = int8_mm_cuda(a.xq, a.wq).to(torch.float32).mul_(a.x_scale)
    return _fp32_epilogue(acc, a)


def int8_rowwise_cpu(a: GemmArgs) -> torch.Tensor:
    """`int8_rowwise_cuda` on the CPU (the same int32 values from `int8_mm_cpu`)."""
    acc = int8_mm_cpu(a.xq, a.wq, a.mirror).to(torch.float32).mul_(a.x_scale)
    return _fp32_epilogue(acc, a)


def int8_group_cuda(a: GemmArgs) -> torch.Tensor:
    """`int8_g*` on CUDA: the Triton kernel (`kernels.launch.int8_group_gemm`) when
    `kernels.use_triton` says so (Triton installed, mode ``auto`` or ``triton``), else the reference
    `int8_group`; the rule is `int8_group_impl`. The kernel takes every shape (masked tiles)."""
    return int8_group_impl(a.xq)(a)


def int8_group_impl(xq: torch.Tensor) -> Callable[[GemmArgs], torch.Tensor]:
    """Which `int8_g*` GEMM `int8_group_cuda` runs for activation codes `xq`: `int8_group_triton`
    when `use_triton(xq)`, else `int8_group` (mode ``torch``, or no triton in mode ``auto``)."""
    return int8_group_triton if use_triton(xq) else int8_group


def int8_group_triton(a: GemmArgs) -> torch.Tensor:
    """`int8_group` as one Triton kernel: exact int32 dot per group, fp32 sum over groups."""
    return launch.int8_group_gemm(
        a.xq, a.x_scale, a.wq, a.w_scale, a.scheme.group_size, a.out_dtype, a.bias
    )


def int8_group(a: GemmArgs) -> torch.Tensor:
    """int8 weights with per-group activation scales (`int8_g*`), the reference path (the CPU's,
    and CUDA's without Triton; `int8_group_cuda`): the scales are applied to the activation codes first (``Y = sum_g s_x[m,g] (Xq_g . Wq_g)
    s_w[n]``, summed in fp32 in another order; no integer kernel takes per-group scales)."""
    _warn_reference_once(a.xq, a.scheme)
    x_deq = dequantize_per_group(a.xq, a.x_scale, a.scheme.group_size)
    return _fp32_epilogue(torch.mm(x_deq, codes_fp32(a.wq, a.mirror).t()), a)


def cublas_aligned(scale: torch.Tensor) -> torch.Tensor:
    """`scale`, copied if its data does not start on a 16-byte boundary. cuBLASLt's fp8 GEMM
    refuses such scales (CUBLAS_STATUS_NOT_SUPPORTED, seen on H100 and H200; pytorch#159957), and
    a scale sliced from a larger tensor (one expert's, some tokens') can start anywhere. Not checked
    while torch.compile traces (fake tensors have no address; its graphs hold whole tensors)."""
    if torch.compiler.is_compiling() or scale.data_ptr() % 16 == 0:
        return scale
    return scale.clone()


def _add_bias(y: torch.Tensor, a: GemmArgs) -> torch.Tensor:
    """``y (+ bias)`` in the output dtype (the fp8 ops apply the scales themselves)."""
    return y if a.bias is None else y + a.bias.to(a.out_dtype)


def fp8_tensorwise_cuda(a: GemmArgs) -> torch.Tensor:
    """FP8 e4m3 with one scale per operand: tensorwise `torch._scaled_mm`."""
    x_scale, w_scale = cublas_aligned(a.x_scale.reshape(())), cublas_aligned(a.w_scale.reshape(()))
    y = torch._scaled_mm(a.xq, a.wq.t(), x_scale, w_scale, out_dtype=a.out_dtype)
    return _add_bias(y, a)


def _rowwise_scales(a: GemmArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales as rowwise `_scaled_mm` takes them, ``[M,1]`` and ``[1,N]`` (a single one broadcast)."""
    scale_a = cublas_aligned(a.x_scale.reshape(-1, 1).expand(a.xq.shape[0], 1).contiguous())
    scale_b = cublas_aligned(a.w_scale.reshape(1, -1).expand(1, a.wq.shape[0]).contiguous())
    return scale_a, scale_b


def fp8_rowwise_cuda(a: GemmArgs) -> torch.Tensor:
    """``(xq @ wq^T) * s_x * s_w^T`` through `torch._scaled_mm` with rowwise scales. Also a
    per-tensor activation scale against a multi-scale weight (a fused layer with one scale per
    checkpoint tensor), as a broadcast rowwise call."""
    scale_a, scale_b = _rowwise_scales(a)
    y = torch._scaled_mm(a.xq, a.wq.t(), scale_a, scale_b, out_dtype=a.out_dtype)
    return _add_bias(y, a)


def fp8_rowwise_cpu(a: GemmArgs) -> torch.Tensor:
    """`fp8_rowwise_cuda` on the CPU, for per-tensor scales too: the fp8 codes decoded to fp32
    (`encode.fp8_to_fp32`) and multiplied in fp32. Every product of two e4m3 values is exact in
    fp32, so this differs from `torch._scaled_mm` only in summation order, and it is several
    times faster than torch's CPU `_scaled_mm` (no CPU has fp8 arithmetic; its tensorwise kernel
    is slower still). Measured: benchmarks/RESULTS.md, "CPU fp8 GEMM"."""
    y = fp8_to_fp32(a.xq) @ codes_fp32(a.wq, a.mirror).t()
    y.mul_(a.x_scale.reshape(-1, 1)).mul_(a.w_scale.reshape(1, -1))  # one scale each broadcasts
    return _add_bias(y.to(a.out_dtype), a)


def fp8_block(a: GemmArgs) -> torch.Tensor:
    """Reference blockwise FP8: 1x128 activation groups and 128x128 weight blocks dequantized to fp32.

    Mathematically ``Y[m,n] = sum_g s_x[m,g] s_w[n//128,g] (Xq_g . Wq_g)``; the fp32 matmul sums the
    same products in a different order. `shard_sizes` describes a fused weight whose row shards each
    have their own block grid (stacked along the scale's first dim).
    """
    _warn_reference_once(a.xq, a.scheme)
    x_deq = dequantize_per_group(a.xq, a.x_scale, a.scheme.group_size)

    def dequantize(q: torch.Tensor) -> torch.Tensor:
        return dequantize_per_block_shards(q, a.w_scale, a.scheme.block_size, a.shard_sizes)

    w_deq = dequantize(a.wq) if a.mirror is None else a.mirror.get(a.wq, dequantize, a.w_scale)
    y = x_deq @ w_deq.t()
    if a.bias is not None:
        y.add_(a.bias.to(torch.float32))
    return y.to(a.out_dtype)


def _warn_reference_once(x: torch.Tensor, scheme: QuantScheme) -> None:
    """Say once per scheme that a CUDA GEMM runs the reference (dequantize + matmul) path."""
    if x.is_cuda and scheme.name not in _warned_reference:
        logger.warning(
            "%s runs the reference (dequantize + matmul) path on CUDA: correct but not fast",
            scheme.name,
        )
        _warned_reference.add(scheme.name)
