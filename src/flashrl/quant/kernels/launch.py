"""Host side of the Triton quantization kernels: argument checks, launch shapes, and one function per
granularity with the signature of its torch reference in `flashrl.quant.primitives` (bit-identical
results); `flashrl.quant.dispatch.QUANTIZERS` picks between the two. Also the host side of the
`int8_g*` GEMM kernel (`int8_group_gemm`, kernel in `group_gemm.py`; reference
`flashrl.quant.gemm.int8_group`, equal within fp32 summation order).

The `quantize_per_*` functions load the `requant` copy that runs on their input
(`flashrl.quant.kernels.kernels_for`: compiled for CUDA tensors, interpreted for CPU tensors); the
`launch_*` helpers take that copy as their first argument. Triton itself is imported only there, so
this module loads on machines without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from flashrl.errors import InputError
from flashrl.quant.encode import block_grid, check_out, qmax_of, raise_if_not_finite
from flashrl.quant.kernels import kernels_for
from flashrl.quant.schemes import AMAX_EPS

ONE_PASS_MAX_K = 16384
"""Rows up to this many elements (rounded up to a power of two) are held in registers and read once;
longer rows take two passes (amax, then quantize)."""
TILE_ELEMENTS = 4096
"""Elements per program for short rows and for activation groups (several rows per program)."""
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
"""No multiply-add contraction: none of the math needs it, and every product and sum then rounds
exactly as written (the products here are exact anyway)."""


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (as `triton.next_power_of_2`)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    k_pow2 = next_power_of_2(max(k, 1))
    if k_pow2 <= ONE_PASS_MAX_K:
        return max(1, min(64, TILE_ELEMENTS // k_pow2)), k_pow2, True
    return 1, 4096, False


def launch_rows(
    kernels: ModuleType,
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
    kernels.quant_rows_kernel[(cdiv(m, block_m),)](
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
        **LAUNCH_OPTIONS,
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
    check_out(out, tuple(x.shape), code_dtype, "out")
    check_out(scale_out, (x.shape[0], 1), torch.float32, "scale_out")
    out = torch.empty(x.shape, dtype=code_dtype, device=x.device) if out is None else out
    scale = (
        torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    if x.numel():
        launch_rows(kernels_for(x), x, out, scale, scale.stride(0), True, code_dtype, qmax)
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
    check_out(out, tuple(x.shape), code_dtype, "out")
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
    kernels = kernels_for(x)
    amax = torch.empty(m, dtype=torch.float32, device=x.device)
    block_m, block_k, _ = _row_launch(k)
    block_k = min(block_k, 4096)
    kernels.rows_amax_kernel[(cdiv(m, block_m),)](
        x,
        amax,
        m,
        k,
        x.stride(0),
        x.stride(1),
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=_warps(block_m * block_k),
        **LAUNCH_OPTIONS,
    )
    kernels.tensor_scale_kernel[(1,)](
        amax, scale, m, QMAX=qmax, EPS=AMAX_EPS, BLOCK=1024, num_warps=4, **LAUNCH_OPTIONS
    )
    launch_rows(kernels, x, out, scale, 0, False, code_dtype, qmax)
    if check_finite:
        raise_if_not_finite(x, scale, "tensor")
    return out, scale


def launch_tiles(
    kernels: ModuleType,
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
    pad_rows, pad_cols = next_power_of_2(rows), next_power_of_2(cols)
    q = _codes_view(out)
    kernels.quant_tiles_kernel[(cdiv(m, rows), cdiv(k, cols))](
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
        **LAUNCH_OPTIONS,
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
    check_out(out, tuple(w.shape), code_dtype, "out")
    check_out(scale_out, grid, torch.float32, "scale_out")
    out = torch.empty(w.shape, dtype=code_dtype, device=w.device) if out is None else out
    scale = (
        torch.empty(grid, dtype=torch.float32, device=w.device) if scale_out is None else scale_out
    )
    if w.numel():
        tile = (int(block[0]), int(block[1]))
        launch_tiles(kernels_for(w), w, out, scale, tile, False, code_dtype, qmax)
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
    check_out(out, (m, k), code_dtype, "out")
    check_out(scale_out, (m, groups), torch.float32, "scale_out")
    out = torch.empty(x.shape, dtype=code_dtype, device=x.device) if out is None else out
    scale = (
        torch.empty(m, groups, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    if x.numel():
        rows = max(1, min(next_power_of_2(m), TILE_ELEMENTS // next_power_of_2(group)))
        launch_tiles(kernels_for(x), x, out, scale, (rows, int(group)), True, code_dtype, qmax)
    if check_finite:
        raise_if_not_finite(x, scale, "tensor")
    return out, scale


# ------------------------------------------------------------------------------------------------
# int8_g* GEMM (group_gemm.py)
# ------------------------------------------------------------------------------------------------


GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Output dtypes of `int8_group_gemm` (each rounded to nearest even from the fp32 result)."""


@dataclass(frozen=True)
class GroupTiles:
    """Launch shape of `int8_group_gemm` (stages None: Triton's default). Every choice gives the
    same bits (each element sums its groups in one order); benchmarks/bench_group_gemm.py times them."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise InputError(f"GroupTiles.{name}={v}: must be a power of two >= 16 (tl.dot)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise InputError(f"GroupTiles.num_warps={self.num_warps}: allowed 1, 2, 4, 8, 16")
        if self.num_stages is not None and not 1 <= self.num_stages <= 8:
            raise InputError(f"GroupTiles.num_stages={self.num_stages}: allowed 1..8 or None")


def group_gemm_tiles(m: int, n: int) -> GroupTiles:
    """The default launch shape of `int8_group_gemm`: small M (decode) takes narrow N tiles.
    Untuned: at M = 64 with CUDA graphs the decode step is 1.56x int8's on an H200
    (benchmarks/RESULTS.md)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 16 else 64 if m <= 64 else 128
    return GroupTiles(block_m, min(block_n, max(16, next_power_of_2(n))))


def _check_group_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> None:
    """Raise `InputError` naming the operand whose shape or dtype the kernel cannot take."""
    m, k = xq.shape
    n = wq.shape[0]
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise InputError(f"int8_group_gemm takes int8 codes, got {xq.dtype} and {wq.dtype}")
    if wq.dim() != 2 or wq.shape[1] != k:
        raise InputError(f"weight codes must be [N, {k}], got {tuple(wq.shape)}")
    if group < 1 or tuple(x_scale.shape) != (m, cdiv(k, group)):
        raise InputError(
            f"activation scales must be [M, ceil(K / group)] = [{m}, {cdiv(k, max(group, 1))}] "
            f"for group {group}, got {tuple(x_scale.shape)}"
        )
    if w_scale.numel() not in (1, n):
        raise InputError(f"weight scales: one per output row ({n}) or one, got {w_scale.numel()}")
    if out_dtype not in GEMM_OUT_DTYPES:
        raise InputError(f"out_dtype {out_dtype} is not one of {GEMM_OUT_DTYPES}")
    if bias is not None and bias.numel() != n:
        raise InputError(f"bias must have {n} elements (one per output row), got {bias.numel()}")


def int8_group_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    tiles: GroupTiles | None = None,
) -> torch.Tensor:
    """``Y = s_w * sum_g s_x[:, g] (Xq_g @ Wq_g^T) (+ bias)`` in `out_dtype`, one Triton kernel:
    codes [M, K] and [N, K], activation scales [M, ceil(K/group)] (fp32), weight scales [N] / [N, 1]
    or one. `flashrl.quant.gemm.int8_group` is its reference. `tiles`: the launch shape (default
    `group_gemm_tiles`); BLOCK_K is one group."""
    _check_group_gemm(xq, x_scale, wq, w_scale, group, out_dtype, bias)
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if y.numel() == 0:
        return y
    x_scale = x_scale.to(torch.float32)
    w_scale = w_scale.reshape(-1).to(torch.float32)
    bias = None if bias is None else bias.reshape(-1).contiguous()
    tiles = tiles or group_gemm_tiles(m, n)
    stages = {} if tiles.num_stages is None else {"num_stages": tiles.num_stages}
    grid = (cdiv(m, tiles.block_m), cdiv(n, tiles.block_n))
    kernels_for(xq, "group_gemm").int8_group_gemm_kernel[grid](
        xq,
        x_scale,
        wq,
        w_scale,
        y if bias is None else bias,  # never read without HAS_BIAS
        y.view(torch.int16) if out_dtype == torch.bfloat16 else y,
        m,
        n,
        k,
        x_scale.shape[1],
        *xq.stride(),
        *x_scale.stride(),
        *wq.stride(),
        0 if w_scale.numel() == 1 else w_scale.stride(0),
        *y.stride(),
        GROUP=group,
        HAS_BIAS=bias is not None,
        OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=max(16, next_power_of_2(group)),  # one group; tl.dot needs >= 16
        num_warps=tiles.num_warps,
        **stages,
        **LAUNCH_OPTIONS,
    )
    return y
