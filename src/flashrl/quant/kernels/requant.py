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

Kernels: `quant_rows_kernel` (per row, and per tensor with a given scale), `rows_amax_kernel` and
`tensor_scale_kernel` (the per-tensor scale: row amax, then one program reduces and writes the
scale over the old one), `quant_tiles_kernel` (128x128 weight blocks and 1x128 activation groups).

The kernels use only Triton builtins (``tl.full``, ``tl.reduce``), no ``triton.language`` functions
that are themselves ``@triton.jit`` (``tl.max``, ``tl.zeros``): those are compiled or interpreted
once, when triton is imported, and would tie the process to one mode.

This module is loaded by `flashrl.quant.kernels`, twice when needed: compiled (CUDA tensors) and
under the Triton interpreter (CPU tensors with TRITON_INTERPRET=1, the tests); call it through there.
"""

from __future__ import annotations

import triton
import triton.language as tl

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


# The combine function of the kernels' ``tl.reduce(x, axis, _max_combine)`` (what ``tl.max`` does for
# fp32 / int32; ``tl.max`` itself is a ``@triton.jit`` function made when triton is imported, and under
# the interpreter it only works if TRITON_INTERPRET was set before ``import triton``, which would tie
# the process to one mode). The interpreter recognises Triton's own combine function and reduces with
# numpy, so the interpreted copy uses it (a custom one is reduced element by element). The compiled
# copy keeps its own `_max_combine` under its own name: torch.compile (inductor) copies the source of
# each ``@triton.jit`` global a user kernel calls under the name in its ``def``, so a global bound to
# a function of another name is undefined in the compiled graph (NameError on an H100, torch 2.11).
if __name__.endswith(
    "_interpreted"
):  # how `flashrl.quant.kernels._load` names the interpreted copy
    _max_combine = getattr(tl.standard, "_elementwise_max", _max_combine)


@triton.jit
def _amax_nan(a, axis):
    """max over `axis` of non-negative `a`, NaN when any element is NaN, like torch's amax.

    A plain max may skip NaN (maxnum on GPU, nanmax in the interpreter), so NaN is reduced on its
    own; one reduction with a NaN-propagating combine function would do, but the interpreter runs
    custom combine functions element by element."""
    is_nan = a != a
    amax = tl.reduce(tl.where(is_nan, float("inf"), a), axis, _max_combine)
    return tl.where(tl.reduce(is_nan.to(tl.int32), axis, _max_combine) > 0, float("nan"), amax)


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
def quant_rows_kernel(
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
def rows_amax_kernel(
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
def tensor_scale_kernel(
    amax_ptr, s_ptr, M, QMAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr
):
    """One program: s_ptr[0] = max(max_i amax_ptr[i], eps) / qmax, written over the old scale."""
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for m0 in range(0, M, BLOCK):
        acc = _max_nan(acc, tl.load(amax_ptr + m0 + offs, mask=m0 + offs < M, other=0.0))
    tl.store(s_ptr, _scale_of(_amax_nan(acc, 0), QMAX, EPS))


@triton.jit
def quant_tiles_kernel(
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
