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

`quantize_weight` and `quantize_activation` run the fused Triton kernels of `flashrl.quant.kernels`
on CUDA tensors (same bits, one or two passes over memory; ``FLASHRL_QUANT_KERNELS`` switches, see
`quantizer_for`); the per-granularity functions below are always the torch reference.

Layouts: a weight is [N, K] (out, in), activations are [M, K]. Scales:
per tensor ``[]``; per row ``[R, 1]``; per block ``[ceil(N/bn), ceil(K/bk)]``; per group
``[M, ceil(K/g)]``. All scales are float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import torch

from flashrl.errors import InputError
from flashrl.quant import kernels as _kernels
from flashrl.quant.schemes import AMAX_EPS, QuantScheme

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


def qmax_of(code_dtype: torch.dtype) -> float:
    """Largest code magnitude: 127 for int8 (symmetric), 448 for float8_e4m3fn."""
    if code_dtype == torch.int8:
        return 127.0
    if code_dtype == torch.float8_e4m3fn:
        return 448.0
    raise ValueError(
        f"unsupported code dtype {code_dtype}; allowed: torch.int8, torch.float8_e4m3fn"
    )


def check_float_input(x: torch.Tensor, name: str = "tensor", ndim: int | None = 2) -> None:
    """Raise a clear error for a non-float or wrongly shaped input (before any quantization)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
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


def _abs_max(t: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
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
    if code_dtype == torch.int8:
        scaled.round_().clamp_(-127.0, 127.0)
    elif code_dtype == torch.float8_e4m3fn:
        scaled.clamp_(-448.0, 448.0)
    else:
        qmax_of(code_dtype)  # raises the clear error
    out.copy_(scaled)
    return out


def _upcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantization math runs in fp32, or in fp64 when fp64 is asked for (test references)."""
    return t.to(torch.float64 if dtype == torch.float64 else torch.float32)


def _check_out(
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


def _quantize_chunked(
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
    _check_out(out, tuple(x.shape), code_dtype, "out")
    scale = scale_from_amax(_abs_max(x), qmax_of(code_dtype), scale_out)

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        chunk.div_(scale)
        return scale

    out = _quantize_chunked(x, code_dtype, out, scale_chunk_, check_finite=check_finite)
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
    _check_out(out, tuple(x.shape), code_dtype, "out")
    _check_out(scale_out, (x.shape[0], 1), torch.float32, "scale_out")
    scale = (
        torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    qmax = qmax_of(code_dtype)

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        s = scale_from_amax(_abs_max(chunk, dim=-1), qmax, scale[rows])
        chunk.div_(s)
        return s

    return _quantize_chunked(x, code_dtype, out, scale_chunk_, check_finite=check_finite), scale


def dequantize_per_row(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Codes times a broadcastable scale ([R, 1] per row, [] per tensor), in `dtype`."""
    return (_upcast(q, dtype) * _upcast(scale, dtype)).to(dtype)


# --------------------------------------------------------------------------------------------
# per 2-D block (weights, DeepSeek-V3 style 128x128)
# --------------------------------------------------------------------------------------------


def block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Number of (row, col) blocks covering `shape`, partial trailing blocks included."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


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
    _check_out(out, tuple(w.shape), code_dtype, "out")
    _check_out(scale_out, grid, torch.float32, "scale_out")
    scale = (
        torch.empty(grid, dtype=torch.float32, device=w.device) if scale_out is None else scale_out
    )
    qmax, (bn, bk) = qmax_of(code_dtype), block

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        tiles = chunk.view(-1, bn, grid[1], bk)
        first = rows.start // bn
        amax = _abs_max(tiles, dim=3).amax(dim=1, keepdim=True)  # inner (contiguous) dim first
        s = scale_from_amax(amax, qmax, scale[first : first + tiles.shape[0]])
        tiles.div_(s[:, None, :, None])
        return s

    out = _quantize_chunked(
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
        _upcast(scale, dtype)
        .repeat_interleave(block[0], dim=0)[:n]
        .repeat_interleave(block[1], dim=1)[:, :k]
    )
    return (_upcast(q, dtype) * expanded).to(dtype)


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
    _check_out(out, (m, k), code_dtype, "out")
    _check_out(scale_out, (m, groups), torch.float32, "scale_out")
    scale = (
        torch.empty(m, groups, dtype=torch.float32, device=x.device)
        if scale_out is None
        else scale_out
    )
    qmax = qmax_of(code_dtype)

    def scale_chunk_(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
        tiles = chunk.view(chunk.shape[0], groups, group)
        s = scale_from_amax(_abs_max(tiles, dim=-1).squeeze(-1), qmax, scale[rows])
        tiles.div_(s[:, :, None])
        return s

    return _quantize_chunked(
        x, code_dtype, out, scale_chunk_, col_align=group, check_finite=check_finite
    ), scale


def dequantize_per_group(
    q: torch.Tensor, scale: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    k = q.shape[1]
    expanded = _upcast(scale, dtype).repeat_interleave(group, dim=1)[:, :k]
    return (_upcast(q, dtype) * expanded).to(dtype)


# --------------------------------------------------------------------------------------------
# scheme-level entry points
# --------------------------------------------------------------------------------------------


def weight_scale_shape(scheme: QuantScheme, shape: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the weight scale tensor of `scheme` for a weight of `shape` [N, K]."""
    if scheme.weight_granularity == "tensor":
        return ()
    if scheme.weight_granularity == "channel":
        return (shape[0], 1)
    if scheme.weight_granularity == "block":
        return block_grid(shape, scheme.block_size)
    raise ValueError(f"scheme {scheme.name!r} does not quantize weights")


_REFERENCE = SimpleNamespace(
    quantize_per_tensor=quantize_per_tensor,
    quantize_per_row=quantize_per_row,
    quantize_per_block=quantize_per_block,
    quantize_per_group=quantize_per_group,
)
"""The torch reference implementations, as the dispatch sees them."""


def quantizer_for(x: torch.Tensor) -> SimpleNamespace | ModuleType:
    """The implementation that quantizes `x`: the Triton kernels (`flashrl.quant.kernels`, same
    functions and bit-identical results) or the torch reference above. Chosen by
    ``FLASHRL_QUANT_KERNELS`` (auto: Triton for CUDA tensors when it is installed); see
    `flashrl.quant.kernels`. This is a speed choice, never a precision one."""
    return _kernels if _kernels.use_triton(x) else _REFERENCE


def quantize_weight(
    w: torch.Tensor,
    scheme: QuantScheme,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    check_finite: bool = True,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight [N, K] with `scheme`'s weight granularity. Returns (codes, scales).

    Runs the Triton kernels or the torch reference (`quantizer_for`); both give the same bits."""
    check_float_input(w, name)
    if scheme.weight_granularity not in ("tensor", "channel", "block"):
        raise ValueError(f"scheme {scheme.name!r} does not quantize weights")
    impl = quantizer_for(w)
    try:
        if scheme.weight_granularity == "tensor":
            return impl.quantize_per_tensor(w, scheme.code_dtype, out, scale_out, check_finite)
        if scheme.weight_granularity == "channel":
            return impl.quantize_per_row(w, scheme.code_dtype, out, scale_out, check_finite)
        return impl.quantize_per_block(
            w, scheme.code_dtype, scheme.block_size, out, scale_out, check_finite
        )
    except InputError as err:
        raise InputError(f"{name}: {err}") from None


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_weight` (up to rounding): codes times their scale, in `dtype`."""
    if scheme.weight_granularity == "block":
        return dequantize_per_block(q, scale, scheme.block_size, dtype)
    return dequantize_per_row(q, scale, dtype)


def quantize_activation(
    x: torch.Tensor, scheme: QuantScheme, check_finite: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization of a 2-D input [M, K] with `scheme`'s activation granularity.

    Scales: ``[]`` (tensor), ``[M, 1]`` (token), ``[M, ceil(K/g)]`` (group). Runs the Triton
    kernels or the torch reference (`quantizer_for`); both give the same bits.
    """
    if scheme.activation_granularity not in ("tensor", "token", "group"):
        raise ValueError(f"scheme {scheme.name!r} does not quantize activations")
    impl = quantizer_for(x)
    if scheme.activation_granularity == "tensor":
        return impl.quantize_per_tensor(x, scheme.code_dtype, check_finite=check_finite)
    if scheme.activation_granularity == "token":
        return impl.quantize_per_row(x, scheme.code_dtype, check_finite=check_finite)
    return impl.quantize_per_group(
        x, scheme.code_dtype, scheme.group_size, check_finite=check_finite
    )
