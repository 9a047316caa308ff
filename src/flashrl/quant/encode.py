"""The building blocks every quantizer shares: input checks, qmax, scale and code rules, the chunked
loop. The rules are listed in `flashrl.quant.primitives`; this module holds the one definition of
each, so the torch reference, the Triton kernels and the vLLM backend round alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashrl.errors import InputError
from flashrl.quant.schemes import AMAX_EPS, FP8_E4M3_QMAX, INT8_QMAX

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def qmax_of(code_dtype: torch.dtype) -> float:
    """Largest code magnitude: 127 for int8 (symmetric), 448 for float8_e4m3fn."""
    if code_dtype == torch.int8:
        return INT8_QMAX
    if code_dtype == torch.float8_e4m3fn:
        return FP8_E4M3_QMAX
    raise ValueError(
        f"unsupported code dtype {code_dtype}; allowed: torch.int8, torch.float8_e4m3fn"
    )


def check_float_input(x: torch.Tensor, name: str = "tensor", ndim: int | None = 2) -> None:
    """Raise a clear error for a non-float or wrongly shaped input (before any quantization)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUTS:
        raise TypeError(
            f"{name} has dtype {x.dtype}; quantization takes a high-precision tensor "
            f"(float32, bfloat16, float16 or float64)"
        )
    if ndim is not None and x.dim() != ndim:
        raise InputError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def raise_if_not_finite(x: torch.Tensor, amax: torch.Tensor, name: str) -> None:
    """Raise if `x` holds NaN or Inf. `amax` is any reduction of |x| (NaN and Inf propagate into it),
    so the common path costs one check of a small tensor; the full count runs only on failure."""
    if bool(torch.isfinite(amax).all()):
        return
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    raise InputError(
        f"{name} contains {count} non-finite value(s) (NaN or Inf), first at index {first}; "
        f"refusing to quantize it"
    )


def abs_max(t: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """max |t| over `dim` (keepdim) as max(amax, -amin): two fast reductions, no |t| temporary.
    NaN propagates through both, so a non-finite input always shows in the result."""
    if dim is None:
        lo, hi = torch.aminmax(t)
        return torch.maximum(hi, lo.neg())
    return torch.maximum(t.amax(dim=dim, keepdim=True), t.amin(dim=dim, keepdim=True).neg())


def scale_from_amax(
    amax: torch.Tensor, qmax: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``max(amax, 1e-10) / qmax`` in fp32 (rules 2 and 4), written into `out` when given."""
    # Divide by a tensor on amax's device, not by the Python float: CUDA torch turns division by a
    # CPU scalar into a multiply by its reciprocal (rule 4), which differs from amax / qmax in the
    # last bit for many amax (about half of them for qmax = 448).
    scale = amax.float().clamp_min(AMAX_EPS)
    scale = scale.div_(torch.full_like(scale, qmax))
    if out is None:
        return scale
    out.copy_(scale.reshape(out.shape))
    return out


def encode_codes(scaled: torch.Tensor, code_dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """Round / clamp an fp32 tensor of ``x / s`` (modified in place) and cast it into `out`."""
    qmax = qmax_of(code_dtype)  # raises the clear error for any other dtype
    if code_dtype == torch.int8:
        scaled.round_()
    scaled.clamp_(-qmax, qmax)
    out.copy_(scaled)
    return out


FP8_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
"""The fp32 value of every e4m3 code, indexed by the code's bits (NaN codes included)."""


def fp8_to_fp32(q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as fp32, bit for bit what ``q.to(torch.float32)`` gives. On the CPU a lookup in
    `FP8_E4M3_VALUES`: torch's CPU cast from fp8 is scalar code, 2-3x slower than the lookup, and
    it is most of a CPU fp8 GEMM's time (the GEMM multiplies the decoded codes in fp32)."""
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return q.to(torch.float32)
    bits = q.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    return torch.index_select(FP8_E4M3_VALUES, 0, bits).view(q.shape)


def upcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantization math runs in fp32, or in fp64 when fp64 is asked for (test references)."""
    if dtype != torch.float64 and t.dtype == torch.float8_e4m3fn:
        return fp8_to_fp32(t)
    return t.to(torch.float64 if dtype == torch.float64 else torch.float32)


def check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, name: str
) -> None:
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise InputError(
            f"{name} has shape {tuple(out.shape)} and dtype {out.dtype}; "
            f"expected shape {tuple(shape)} and dtype {dtype}"
        )


CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 28}
"""Rows are processed in chunks of about this many elements through one reused fp32 workspace. On
CPU, small chunks keep temporaries in cache and allocate nothing per chunk (3x faster than
whole-tensor ops on a 4096x14336 weight on 2 cores); on CUDA, one chunk avoids many small launches.
Results do not depend on the chunking."""


def quantize_chunked(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    out: torch.Tensor | None,
    scale_chunk_: Callable[[torch.Tensor, slice], torch.Tensor],
    row_align: int = 1,
    col_align: int = 1,
    name: str = "tensor",
    check_finite: bool = True,
) -> torch.Tensor:
    """The shared quantization loop over row chunks of a 2-D `x`.

    Each chunk is upcast into a zero-padded fp32 workspace (rows to `row_align`, columns to
    `col_align`, so partial blocks and groups see zeros); ``scale_chunk_(chunk, rows)`` computes
    and stores the chunk's scales, divides the chunk by them in place and returns them (for the
    finite check); the chunk is then rounded / clamped and cast into ``out[rows]``.
    """
    n, k = x.shape
    out = torch.empty(n, k, dtype=code_dtype, device=x.device) if out is None else out
    k_pad = math.ceil(k / col_align) * col_align
    n_pad = math.ceil(n / row_align) * row_align
    budget = CHUNK_ELEMENTS.get(x.device.type, CHUNK_ELEMENTS["cuda"])
    if n_pad * k_pad <= budget and (n_pad, k_pad) == (n, k):  # one chunk, no padding: no workspace
        chunk = x.to(torch.float32, copy=True)
        scale = scale_chunk_(chunk, slice(0, n))
        if check_finite:
            raise_if_not_finite(x, scale, name)
        return encode_codes(chunk, code_dtype, out)
    step = max(row_align, budget // max(k_pad, 1) // row_align * row_align)
    workspace = torch.empty(min(step, n_pad), k_pad, dtype=torch.float32, device=x.device)
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        count = rows.stop - rows.start
        chunk = workspace[: math.ceil(count / row_align) * row_align]
        chunk[:count, :k].copy_(x[rows])
        chunk[:count, k:].zero_()
        chunk[count:].zero_()
        scale = scale_chunk_(chunk, rows)
        if check_finite:
            raise_if_not_finite(x, scale, name)
        encode_codes(chunk[:count, :k], code_dtype, out[rows])
    return out


def block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Number of (row, col) blocks covering `shape`, partial trailing blocks included."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])
