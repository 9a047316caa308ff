"""Triton GEMM for the `int8_g*` schemes: int8 weight codes with one scale per output row, int8
activation codes with one scale per (token, group of g input channels).

``Y[m, n] = s_w[n] * sum_g s_x[m, g] * (sum_{k in group g} Xq[m, k] * Wq[n, k]) (+ bias[n])``

The blockwise-scaled GEMM pattern of vLLM's former ``w8a8_block_int8_matmul`` (and sglang's
equivalents), with a per-row weight scale instead of a weight block grid: a program owns a
BLOCK_M x BLOCK_N output tile and walks K one group at a time. Each step is one ``tl.dot`` of int8
tiles with an int32 result, exact (|sum| <= g * 127 * 127 < 2^31 for any g < 2^17); it becomes fp32
(exact while g * 127 * 127 < 2^24, i.e. g <= 1040) and is scaled by that group's activation scales.
Only the fp32 sum over groups rounds. The weight scale and the bias are applied once at the end,
in fp32 and in the reference's order (``acc * s_w``, then ``+ bias``), then one rounding to the
output dtype, to nearest even as torch's ``.to()``: fp16 and fp32 by Triton's cast, bf16 by
`_bf16_bits` (the interpreter's fp32 -> bf16 cast truncates, so the kernel rounds in integer steps
that every backend computes alike). Outputs therefore equal the fp32 output cast by torch, bit
for bit.

BLOCK_K is the group size rounded up to a power of two and to at least 16 (``tl.dot`` needs tiles
of 16 or more in every dimension); columns past the group, past K, and rows past M or N are masked
to zero codes, so any M, N, K and group size run without padding copies.

Like `requant`, the kernel uses only Triton builtins (``tl.full``, not ``tl.zeros``; no
``tl.cdiv``): ``@triton.jit`` functions of ``triton.language`` are made once at ``import triton``
and would tie the process to compiled or interpreted mode. Loaded by `flashrl.quant.kernels`
(compiled for CUDA tensors, interpreted for CPU tensors under TRITON_INTERPRET=1); call it through
`flashrl.quant.kernels.launch.int8_group_gemm`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bf16_bits(y):
    """fp32 -> the bf16 bit pattern as int16, rounded to nearest even in integer steps (exact on
    every backend; the interpreter's own cast truncates); NaN -> the quiet NaN 0x7FC0. The sum
    overflows only for NaN inputs, which the final select replaces."""
    bits = y.to(tl.int32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return tl.where(y != y, 0x7FC0, bits >> 16).to(tl.int16)


@triton.jit
def int8_group_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUPS,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_xsg,
    stride_wn,
    stride_wk,
    stride_ws,
    stride_ym,
    stride_yn,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of Y (program_id(0) over M, program_id(1) over N); the loop runs
    over the GROUPS = ceil(K / GROUP) groups, one BLOCK_K >= GROUP tile of K each. OUT_BF16: the
    output is written as bf16 bits through an int16 view (`_bf16_bits`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows = rows.to(tl.int64)
    cols = cols.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_cols = w_ptr + cols[None, :] * stride_wn
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for g in range(0, GROUPS):
        ks = g * GROUP + offs_k
        k_ok = (offs_k < GROUP) & (ks < K)
        ks = ks.to(tl.int64)
        xq = tl.load(
            x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0
        )
        wq = tl.load(
            w_cols + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0
        )
        dot = tl.dot(xq, wq, out_dtype=tl.int32)
        s_x = tl.load(xs_ptr + rows * stride_xsm + g * stride_xsg, mask=row_ok, other=0.0)
        acc += dot.to(tl.float32) * s_x[:, None]
    s_w = tl.load(ws_ptr + cols * stride_ws, mask=col_ok, other=0.0)
    acc = acc * s_w[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    out = _bf16_bits(acc) if OUT_BF16 else acc.to(y_ptr.dtype.element_ty)  # bf16: an int16 view
    tl.store(y, out, mask=row_ok[:, None] & col_ok[None, :])
