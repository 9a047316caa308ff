"""Triton quantization kernels whose codes and scales are bit-identical to `flashrl.quant.primitives`.

The reference quantizer runs chunked torch ops (upcast copy, amax, divide, round, clamp, cast): about
15x the memory traffic of one fused pass. These kernels read the high-precision tensor once or
twice and write codes and scales once, with the same math (shared/reference/numerics.md section 2):

- fp32 arithmetic: every element is upcast to fp32 on load (exact for bf16 / fp16, round to nearest
  even for fp64, as ``Tensor.to(float32)``); amax of the fp32 values equals the reference's amax.
- ``s = max(amax, 1e-10) / qmax`` with an IEEE division (`tl.math.div_rn`). Plain ``/`` in Triton
  lowers to an approximate division on NVIDIA GPUs (``div.full.f32``), which is why it never appears.
- codes from ``div_rn(x, s)``, the one division rule: never ``x * (1 / s)``.
- NaN-propagating maxima (`_amax_nan`, `_max_nan`): a NaN anywhere in a row, block or group reaches its scale,
  so the caller's finite check on the small scale tensor sees it (Triton's default max may drop NaN).
- Rounding is done in fp32 arithmetic that is exact on every backend, not by a conversion whose
  rounding differs between backends (the Triton interpreter's fp32 -> fp8 cast rounds ties away from
  zero): int8 is ``round_half_even(clamp(y, -127, 127))`` (equal to the reference's
  ``clamp(round(y))``); fp8 clamps to [-448, 448], rounds to the e4m3 grid with `_round_half_even`
  on an exactly scaled copy and assembles the e4m3 bit pattern itself (stored through a uint8 view of
  the float8_e4m3fn output), which is what torch's round-to-nearest-even cast gives. No Triton fp8
  type is needed, so the kernels also run on GPUs without fp8 conversion instructions.
- Padding: masked loads read zeros past the edges, like the reference's zero-padded workspace.

Codes of non-finite inputs are unspecified (the reference refuses such weights, and so do these
kernels, through the same `raise_if_not_finite`); activations are quantized without that check,
also like the reference.

Kernels: `_quant_rows_kernel` (per row, and per tensor with a given scale), `_rows_amax_kernel` and
`_tensor_scale_kernel` (the per-tensor scale: row amax, then one program reduces and writes the
scale over the old one), `_quant_tiles_kernel` (128x128 weight blocks and 1x128 activation groups).

The kernels use only Triton builtins (``tl.full``, ``tl.reduce``), no ``triton.language`` functions
that are themselves ``@triton.jit`` (``tl.max``, ``tl.zeros``): those are compiled or interpreted
once, when triton is imported, and would tie the process to one mode.

This module is loaded by `flashrl.quant.kernels`, twice when needed: compiled (CUDA tensors) and
under the Triton interpreter (CPU tensors with TRITON_INTERPRET=1, the tests); call it through there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrl.errors import InputError
from flashrl.quant.primitives import _check_out, block_grid, qmax_of, raise_if_not_finite
from flashrl.quant.schemes import AMAX_EPS

ONE_PASS_MAX_K = 16384
"""Rows up to this many elements (rounded up to a power of two) are held in registers and read once;
longer rows take two passes (amax, then quantize)."""
TILE_ELEMENTS = 4096
"""Elements per program for short rows and for activation groups (several rows per program)."""
_OPTIONS = {"enable_fp_fusion": False}
"""No multiply-add contraction: none of the math needs it, and every product and sum then rounds
exactly as written (the products here are exact anyway)."""


# ------------------------------------------------------------------------------------------------
# device helpers
# ------------------------------------------------------------------------------------------------


@triton.jit
def _max_nan(a, b):
    """Elementwise max that propagates NaN, so a non-finite input always reaches its scale."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


_MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _max_combine)
"""The combine function of `tl.max`. The kernels call ``tl.reduce(x, axis, _MAX_COMBINE)``, which is
what ``tl.max`` does for fp32 / int32, because ``tl.max`` is itself a ``@triton.jit`` function made
when triton is imported: under the interpreter it only works if TRITON_INTERPRET was set before
``import triton``, which would tie the whole process to one mode. The interpreter recognises Triton's
own combine function and reduces with numpy; `_max_combine` (same result, reduced element by element
under the interpreter) is there for a triton without it."""


@triton.jit
def _amax_nan(a, axis):
    """max over `axis` of non-negative `a`, NaN when any element is NaN, like torch's amax.

    A plain max may skip NaN (maxnum on GPU, nanmax in the interpreter), so NaN is reduced on its
    own; one reduction with a NaN-propagating combine function would do, but the interpreter runs
    custom combine functions element by element."""
    is_nan = a != a
    amax = tl.reduce(tl.where(is_nan, float("inf"), a), axis, _MAX_COMBINE)
    return tl.where(tl.reduce(is_nan.to(tl.int32), axis, _MAX_COMBINE) > 0, float("nan"), amax)


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr, EPS: tl.constexpr):
    """``max(amax, eps) / qmax`` with an IEEE (round to nearest) division."""
    return tl.math.div_rn(_max_nan(amax, EPS), QMAX)


@triton.jit
def _round_half_even(v):
    """Round to the nearest integer, ties to even, in exact fp32 steps (|v| < 2^23). NVIDIA's floor
    (``cvt.rmi.ftz``) flushes subnormal inputs to zero; those round to 0 either way."""
    f = tl.floor(v)
    d = v - f
    odd = (f.to(tl.int32) & 1) != 0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _encode(y, IS_INT8: tl.constexpr):
    """fp32 ``x / s`` -> int32 codes: the int8 value, or the float8_e4m3fn bit pattern (0..255).

    e4m3 (bias 7, 3 mantissa bits): for |y| in [2^e, 2^(e+1)) with e >= -6 the grid spacing is
    2^(e-3); below 2^-6 it is 2^-9 (subnormals), i.e. e is floored at -6. With
    ``n = round_half_even(|y| * 2^(3-e))`` (the product is exact) the bit pattern is
    ``(e + 6) * 8 + n`` for normals and subnormals alike (n = 16 carries into the next binade).
    """
    if IS_INT8:
        y = tl.clamp(y, -127.0, 127.0, propagate_nan=tl.PropagateNan.ALL)
        y = tl.where(y == y, y, 0.0)
        code = _round_half_even(y).to(tl.int32)
    else:
        y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        bits = y.to(tl.int32, bitcast=True)
        is_nan = y != y
        mag = tl.where(is_nan, 0, bits & 0x7FFFFFFF)
        e = tl.maximum((mag >> 23) - 127, -6)
        up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
        n = _round_half_even(mag.to(tl.float32, bitcast=True) * up).to(tl.int32)
        code = tl.where(is_nan, 0x7F, (e + 6) * 8 + n)
        code = tl.where(bits < 0, code | 0x80, code)
    return code


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    stride_s,
    COMPUTE_SCALE: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """Quantize BLOCK_M rows of x [M, K]. COMPUTE_SCALE: the row scale is computed and written to
    ``s_ptr[row * stride_s]``; otherwise it is read from there (stride_s = 0: one per-tensor scale).
    ONE_PASS: the row fits one BLOCK_K tile and is read once; else two passes over K."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xm
    q_rows = q_ptr + rows[:, None] * stride_qm
    if ONE_PASS:
        mask = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if COMPUTE_SCALE:
            s = _scale_of(_amax_nan(tl.abs(x), 1), QMAX, EPS)
            tl.store(s_ptr + rows * stride_s, s, mask=row_ok)
        else:
            s = tl.load(s_ptr + rows * stride_s, mask=row_ok, other=1.0)
        q = _encode(tl.math.div_rn(x, s[:, None]), IS_INT8)
        tl.store(q_rows + cols[None, :] * stride_qk, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        if COMPUTE_SCALE:
            amax = tl.full([BLOCK_M], 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mask = row_ok[:, None] & (k0 + cols[None, :] < K)
                x = tl.load(x_rows + (k0 + cols[None, :]) * stride_xk, mask=mask, other=0.0).to(
                    tl.float32
                )
                amax = _max_nan(amax, _amax_nan(tl.abs(x), 1))
            s = _scale_of(amax, QMAX, EPS)
            tl.store(s_ptr + rows * stride_s, s, mask=row_ok)
        else:
            s = tl.load(s_ptr + rows * stride_s, mask=row_ok, other=1.0)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (k0 + cols[None, :] < K)
            x = tl.load(x_rows + (k0 + cols[None, :]) * stride_xk, mask=mask, other=0.0).to(
                tl.float32
            )
            q = _encode(tl.math.div_rn(x, s[:, None]), IS_INT8)
            tl.store(
                q_rows + (k0 + cols[None, :]) * stride_qk, q.to(q_ptr.dtype.element_ty), mask=mask
            )


@triton.jit
def _rows_amax_kernel(
    x_ptr,
    amax_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """amax_ptr[row] = max |x[row, :]| in fp32 (NaN-propagating), for BLOCK_M rows."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    amax = tl.full([BLOCK_M], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = row_ok[:, None] & (k0 + cols[None, :] < K)
        x = tl.load(x_rows + (k0 + cols[None, :]) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        amax = _max_nan(amax, _amax_nan(tl.abs(x), 1))
    tl.store(amax_ptr + rows, amax, mask=row_ok)


@triton.jit
def _tensor_scale_kernel(
    amax_ptr, s_ptr, M, QMAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr
):
    """One program: s_ptr[0] = max(max_i amax_ptr[i], eps) / qmax, written over the old scale."""
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for m0 in range(0, M, BLOCK):
        acc = _max_nan(acc, tl.load(amax_ptr + m0 + offs, mask=m0 + offs < M, other=0.0))
    tl.store(s_ptr, _scale_of(_amax_nan(acc, 0), QMAX, EPS))


@triton.jit
def _quant_tiles_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    stride_sm,
    stride_sk,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    PAD_COLS: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    EPS: tl.constexpr,
):
    """Quantize the ROWS x COLS tile (program_id(0), program_id(1)) of x [M, K] (PAD_*: the next
    powers of two). ROW_SCALES: one scale per row of the tile, i.e. 1 x COLS groups with scales
    [M, ceil(K / COLS)]; else one scale per tile, i.e. blocks with scales
    [ceil(M / ROWS), ceil(K / COLS)]. Elements past M or K are read as zeros (zero padding)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, PAD_ROWS)
    c = tl.arange(0, PAD_COLS)
    rows = pid_m * ROWS + r
    cols = pid_k * COLS + c
    row_ok = (r < ROWS) & (rows < M)
    mask = row_ok[:, None] & ((c < COLS) & (cols < K))[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    row_amax = _amax_nan(tl.abs(x), 1)
    if ROW_SCALES:
        s = _scale_of(row_amax, QMAX, EPS)
        tl.store(s_ptr + rows * stride_sm + pid_k * stride_sk, s, mask=row_ok)
        y = tl.math.div_rn(x, s[:, None])
    else:
        s = _scale_of(_amax_nan(row_amax, 0), QMAX, EPS)
        tl.store(s_ptr + pid_m * stride_sm + pid_k * stride_sk, s)
        y = tl.math.div_rn(x, s)
    q = _encode(y, IS_INT8)
    tl.store(
        q_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qk,
        q.to(q_ptr.dtype.element_ty),
        mask=mask,
    )


# ------------------------------------------------------------------------------------------------
# host side: the reference signatures
# ------------------------------------------------------------------------------------------------


def _check_args(x: torch.Tensor, code_dtype: torch.dtype, *outs: torch.Tensor | None) -> float:
    """Validate what the reference validates implicitly; return qmax."""
    qmax = qmax_of(code_dtype)
    if x.dim() != 2:
        raise InputError(f"tensor must be 2-D, got shape {tuple(x.shape)}")
    for out in outs:
        if out is not None and out.device != x.device:
            raise InputError(
                f"output buffer is on {out.device}, the input on {x.device}; they must match"
            )
    return qmax


def _codes_view(out: torch.Tensor) -> torch.Tensor:
    """What the kernels store into: int8 codes as they are, e4m3 bit patterns through a uint8 view."""
    return out if out.dtype == torch.int8 else out.view(torch.uint8)


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def _row_launch(k: int) -> tuple[int, int, bool]:
    """(BLOCK_M, BLOCK_K, ONE_PASS) for rows of k elements."""
    k_pow2 = triton.next_power_of_2(max(k, 1))
    if k_pow2 <= ONE_PASS_MAX_K:
        return max(1, min(64, TILE_ELEMENTS // k_pow2)), k_pow2, True
    return 1, 4096, False


def _launch_rows(
    x: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    stride_s: int,
    compute_scale: bool,
    code_dtype: torch.dtype,
    qmax: float,
) -> None:
    m, k = x.shape
    block_m, block_k, one_pass = _row_launch(k)
    q = _codes_view(out)
    _quant_rows_kernel[(triton.cdiv(m, block_m),)](
        x,
        q,
        scale,
        m,
        k,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        q.stride(1),
        stride_s,
        COMPUTE_SCALE=compute_scale,
        IS_INT8=code_dtype == torch.int8,
        QMAX=qmax,
        EPS=AMAX_EPS,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        ONE_PASS=one_pass,
        num_warps=_warps(block_m * block_k),
        **_OPTIONS,
    )


def quantize_per_row(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`primitives.quantize_per_row` as one kernel: codes [R, C] and scales [R, 1]."""
    qmax = _check_args(x, code_dtype, out, scale_out)
    _check_out(out, tuple(x.shape), code_dtype, "out")
    _check_out(scale_out, (x.shape[0], 1), torch.float32, "scale_out")
    out = torch.empty(x.shape, dtype=code_dtype, device=x.device) if out is None else out
    scale = (
        torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    if x.numel():
        _launch_rows(x, out, scale, scale.stride(0), True, code_dtype, qmax)
    if check_finite:
        raise_if_not_finite(x, scale, "tensor")
    return out, scale


def quantize_per_tensor(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`primitives.quantize_per_tensor` in three launches: row amax, the scale (overwriting
    `scale_out`, never max-ed into it), then the codes. Returns (codes, scale of shape [])."""
    qmax = _check_args(x, code_dtype, out, scale_out)
    _check_out(out, tuple(x.shape), code_dtype, "out")
    if scale_out is not None and scale_out.numel() != 1:
        raise InputError(
            f"scale_out has shape {tuple(scale_out.shape)}; a per-tensor scale has one element"
        )
    if x.numel() == 0:
        raise InputError("cannot quantize an empty tensor per tensor (its amax is undefined)")
    out = torch.empty(x.shape, dtype=code_dtype, device=x.device) if out is None else out
    scale = (
        torch.empty((), dtype=torch.float32, device=x.device) if scale_out is None else scale_out
    )
    m, k = x.shape
    amax = torch.empty(m, dtype=torch.float32, device=x.device)
    block_m, block_k, _ = _row_launch(k)
    block_k = min(block_k, 4096)
    _rows_amax_kernel[(triton.cdiv(m, block_m),)](
        x,
        amax,
        m,
        k,
        x.stride(0),
        x.stride(1),
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=_warps(block_m * block_k),
        **_OPTIONS,
    )
    _tensor_scale_kernel[(1,)](
        amax, scale, m, QMAX=qmax, EPS=AMAX_EPS, BLOCK=1024, num_warps=4, **_OPTIONS
    )
    _launch_rows(x, out, scale, 0, False, code_dtype, qmax)
    if check_finite:
        raise_if_not_finite(x, scale, "tensor")
    return out, scale


def _launch_tiles(
    x: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    tile: tuple[int, int],
    row_scales: bool,
    code_dtype: torch.dtype,
    qmax: float,
) -> None:
    m, k = x.shape
    rows, cols = tile
    pad_rows, pad_cols = triton.next_power_of_2(rows), triton.next_power_of_2(cols)
    q = _codes_view(out)
    _quant_tiles_kernel[(triton.cdiv(m, rows), triton.cdiv(k, cols))](
        x,
        q,
        scale,
        m,
        k,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        q.stride(1),
        scale.stride(0),
        scale.stride(1),
        ROWS=rows,
        COLS=cols,
        PAD_ROWS=pad_rows,
        PAD_COLS=pad_cols,
        ROW_SCALES=row_scales,
        IS_INT8=code_dtype == torch.int8,
        QMAX=qmax,
        EPS=AMAX_EPS,
        num_warps=_warps(pad_rows * pad_cols),
        **_OPTIONS,
    )


def quantize_per_block(
    w: torch.Tensor,
    code_dtype: torch.dtype,
    block: tuple[int, int] = (128, 128),
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`primitives.quantize_per_block`, one program per block: codes [N, K] and scales
    [ceil(N/bn), ceil(K/bk)]; partial edge blocks see zeros past the edge."""
    qmax = _check_args(w, code_dtype, out, scale_out)
    grid = block_grid(tuple(w.shape), block)
    _check_out(out, tuple(w.shape), code_dtype, "out")
    _check_out(scale_out, grid, torch.float32, "scale_out")
    out = torch.empty(w.shape, dtype=code_dtype, device=w.device) if out is None else out
    scale = (
        torch.empty(grid, dtype=torch.float32, device=w.device) if scale_out is None else scale_out
    )
    if w.numel():
        _launch_tiles(w, out, scale, (int(block[0]), int(block[1])), False, code_dtype, qmax)
    if check_finite:
        raise_if_not_finite(w, scale, "tensor")
    return out, scale


def quantize_per_group(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    group: int = 128,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`primitives.quantize_per_group`: codes [M, K] and scales [M, ceil(K/g)], several rows of one
    group per program."""
    qmax = _check_args(x, code_dtype, out, scale_out)
    m, k = x.shape
    groups = -(-k // group)
    _check_out(out, (m, k), code_dtype, "out")
    _check_out(scale_out, (m, groups), torch.float32, "scale_out")
    out = torch.empty(x.shape, dtype=code_dtype, device=x.device) if out is None else out
    scale = (
        torch.empty(m, groups, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    if x.numel():
        rows = max(
            1, min(triton.next_power_of_2(m), TILE_ELEMENTS // triton.next_power_of_2(group))
        )
        _launch_tiles(x, out, scale, (rows, int(group)), True, code_dtype, qmax)
    if check_finite:
        raise_if_not_finite(x, scale, "tensor")
    return out, scale
