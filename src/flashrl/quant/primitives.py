"""Quantize / dequantize primitives for every granularity: pure functions with optional in-place outputs.

These functions are the reference quantizer of flashrl: the GEMMs, `QuantLinear.requantize_`, the
vLLM backend and the tests all call them, so there is one definition of every code and scale.
The rules (shared/reference/numerics.md section 2):

1. fp32 arithmetic: inputs (bf16, fp16, fp32) are upcast before scales and ``x / s`` are computed.
   amax is taken on the input dtype, which is exact (abs and max do not round).
2. Scale floor: ``s = max(amax, 1e-10) / qmax``, so zero rows, blocks and padding give finite scales.
3. Clamp before the cast: int8 is ``clamp(round(x / s), -127, 127)``, fp8 is
   ``clamp(x / s, -448, 448)`` then a round-to-nearest-even cast. A bare fp8 cast of an out-of-range
   value is not portable (NaN on some paths, saturation on others); an out-of-range int8 cast is UB.
4. One division rule: always ``x / s`` in fp32 (never ``x * (1 / s)``), so every path rounds alike.
5. Fresh scales: a scale is computed from the tensor being quantized only, and written over the
   scale buffer (never max-ed with an old value).

Shapes not divisible by the block or group size are zero-padded for the scale computation: zeros
leave every amax unchanged, so a trailing partial block is quantized exactly as if it were whole.

The functions below are always the torch reference. `flashrl.quant.dispatch` (`quantize_weight`,
`quantize_activation`) runs them, or the fused Triton kernels of `flashrl.quant.kernels` with the
same signatures and the same bits on CUDA tensors (``FLASHRL_QUANT_KERNELS`` switches).

Layouts: a weight is [N, K] (out, in), activations are [M, K]. Scales:
per tensor ``[]``; per row ``[R, 1]``; per block ``[ceil(N/bn), ceil(K/bk)]``; per group
``[M, ceil(K/g)]``. All scales are float32.
"""

from __future__ import annotations

import math

import torch

from flashrl.quant.encode import (  # noqa: F401  (re-exported: the primitives' public API)
    CHUNK_ELEMENTS,
    FLOAT_INPUTS,
    abs_max,
    block_grid,
    check_float_input,
    check_out,
    encode_codes,
    qmax_of,
    quantize_chunked,
    raise_if_not_finite,
    scale_from_amax,
    upcast,
)

# --------------------------------------------------------------------------------------------
# per tensor
# --------------------------------------------------------------------------------------------


def quantize_per_tensor(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 scale for the whole 2-D tensor. Returns (codes like x, scale of shape [])."""
    check_out(out, tuple(x.shape), code_dtype, "out")
    scale = scale_from_amax(abs_max(x), qmax_of(code_dtype), scale_out)

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        chunk.div_(scale)
        return scale

    out = quantize_chunked(x, code_dtype, out, scale_chunk_, check_finite=check_finite)
    return out, scale


def dequantize_per_tensor(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return dequantize_per_row(q, scale, dtype)  # the same broadcast multiply


# --------------------------------------------------------------------------------------------
# per row: per output channel for weights [N, K], per token for activations [M, K]
# --------------------------------------------------------------------------------------------


def quantize_per_row(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 scale per row of a 2-D tensor. Returns (codes [R, C], scales [R, 1])."""
    check_out(out, tuple(x.shape), code_dtype, "out")
    check_out(scale_out, (x.shape[0], 1), torch.float32, "scale_out")
    scale = (
        torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    qmax = qmax_of(code_dtype)

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        s = scale_from_amax(abs_max(chunk, dim=-1), qmax, scale[rows])
        chunk.div_(s)
        return s

    return quantize_chunked(x, code_dtype, out, scale_chunk_, check_finite=check_finite), scale


def dequantize_per_row(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Codes times a broadcastable scale ([R, 1] per row, [] per tensor), in `dtype`."""
    return (upcast(q, dtype) * upcast(scale, dtype)).to(dtype)


# --------------------------------------------------------------------------------------------
# per 2-D block (weights, DeepSeek-V3 style 128x128)
# --------------------------------------------------------------------------------------------


def quantize_per_block(
    w: torch.Tensor,
    code_dtype: torch.dtype,
    block: tuple[int, int] = (128, 128),
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 scale per [bn, bk] block. Returns (codes [N, K], scales [ceil(N/bn), ceil(K/bk)]).

    Partial blocks at the right and bottom edges are zero-padded for the amax (exact, see module doc).
    """
    grid = block_grid(tuple(w.shape), block)
    check_out(out, tuple(w.shape), code_dtype, "out")
    check_out(scale_out, grid, torch.float32, "scale_out")
    scale = (
        torch.empty(grid, dtype=torch.float32, device=w.device) if scale_out is None else scale_out
    )
    qmax, (bn, bk) = qmax_of(code_dtype), block

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        tiles = chunk.view(-1, bn, grid[1], bk)
        first = rows.start // bn
        amax = abs_max(tiles, dim=3).amax(dim=1, keepdim=True)  # inner (contiguous) dim first
        s = scale_from_amax(amax, qmax, scale[first : first + tiles.shape[0]])
        tiles.div_(s[:, None, :, None])
        return s

    out = quantize_chunked(
        w, code_dtype, out, scale_chunk_, row_align=bn, col_align=bk, check_finite=check_finite
    )
    return out, scale


def dequantize_per_block(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    n, k = q.shape
    expanded = (
        upcast(scale, dtype)
        .repeat_interleave(block[0], dim=0)[:n]
        .repeat_interleave(block[1], dim=1)[:, :k]
    )
    return (upcast(q, dtype) * expanded).to(dtype)


def dequantize_per_block_shards(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    shard_sizes: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a fused weight whose row shards were block-quantized one by one: shard i owns
    ``ceil(shard_sizes[i] / bn)`` consecutive rows of `scale`."""
    if shard_sizes is None or len(shard_sizes) <= 1:
        return dequantize_per_block(q, scale, block, dtype)
    parts, row, block_row = [], 0, 0
    for size in shard_sizes:
        nb = math.ceil(size / block[0])
        parts.append(
            dequantize_per_block(
                q[row : row + size], scale[block_row : block_row + nb], block, dtype
            )
        )
        row, block_row = row + size, block_row + nb
    return torch.cat(parts)


# --------------------------------------------------------------------------------------------
# per group along the last dim (activations, 1x128)
# --------------------------------------------------------------------------------------------


def quantize_per_group(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    group: int = 128,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 scale per row and group of `group` columns. Returns (codes [M, K], scales [M, ceil(K/g)])."""
    m, k = x.shape
    groups = math.ceil(k / group)
    check_out(out, (m, k), code_dtype, "out")
    check_out(scale_out, (m, groups), torch.float32, "scale_out")
    scale = (
        torch.empty(m, groups, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    qmax = qmax_of(code_dtype)

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        tiles = chunk.view(chunk.shape[0], groups, group)
        s = scale_from_amax(abs_max(tiles, dim=-1).squeeze(-1), qmax, scale[rows])
        tiles.div_(s[:, :, None])
        return s

    return quantize_chunked(
        x, code_dtype, out, scale_chunk_, col_align=group, check_finite=check_finite
    ), scale


def dequantize_per_group(
    q: torch.Tensor, scale: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    k = q.shape[1]
    expanded = upcast(scale, dtype).repeat_interleave(group, dim=1)[:, :k]
    return (upcast(q, dtype) * expanded).to(dtype)
