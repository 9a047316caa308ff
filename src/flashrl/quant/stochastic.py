"""Stochastic rounding at weight update: rollout weights whose expectation is the trainer's weight.

Rounding an fp32 master weight to the nearest bf16 value (or int8 / fp8 code) erases every update
smaller than half a grid step, and the erased part is not noise: it points along the gradient, so a
bf16 rollout engine falls behind an fp32 trainer step after step (docs/real-model.md). Rounding up
with probability equal to the distance from the lower neighbour, in grid units, makes the stored
value unbiased, ``E[stored] = target``: updates of any size survive on average, at the cost of
rounding noise of at most one grid step per weight, fresh at every update.

`stochastic_round_` works on a nearest-rounded tensor and its fp32 target, for int8 codes and for
the float grids bf16, fp16 and float8_e4m3fn (neighbours found on the bit pattern, so subnormals
and exponent boundaries are exact). `round_to_dtype` and `stochastic_codes_` build on it for dense
weights and for quantized codes with their fresh scales.
"""

from __future__ import annotations

import torch

from flashrl.quant.schemes import QuantScheme

FLOAT_GRIDS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
}
"""Float grids: the integer view of the bit pattern and the magnitude mask (sign-magnitude)."""


def _other_neighbour(rounded: torch.Tensor, toward_up: torch.Tensor) -> torch.Tensor:
    """The grid value next to `rounded` on the side `toward_up` (True: larger) as fp32."""
    if rounded.dtype == torch.int8:
        step = torch.where(toward_up, 1, -1).to(torch.int16)
        return (rounded.to(torch.int16) + step).clamp_(-127, 127).to(torch.float32)
    view, mask = FLOAT_GRIDS[rounded.dtype]
    bits = rounded.view(view).to(torch.int32)
    sign_bit = mask + 1
    magnitude, negative = bits & mask, (bits & sign_bit) != 0
    away = toward_up != negative  # moving up from a positive value or down from a negative one
    zero = magnitude == 0
    new_magnitude = torch.where(away | zero, magnitude + 1, magnitude - 1)
    new_negative = torch.where(zero, ~toward_up, negative)
    new_bits = new_magnitude | torch.where(new_negative, sign_bit, 0)
    if view == torch.int16:  # back to the signed range of the view (0x8000.. are negative)
        new_bits = torch.where(new_bits >= 0x8000, new_bits - 0x10000, new_bits)
    return new_bits.to(view).view(rounded.dtype).to(torch.float32)


def stochastic_round_(
    rounded: torch.Tensor, target: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Turn `rounded` (the nearest grid value of fp32 `target`, same shape) into a stochastic rounding
    of `target`, in place: the grid value below or above `target`, the one above with probability
    ``(target - below) / (above - below)``, so ``E[result] = target`` wherever `target` lies between
    two finite grid values. Grids: int8 codes (clamped to +-127), bf16, fp16, float8_e4m3fn.

    Fast paths (one pass or two over memory): int8 is ``floor(target + u)``; bf16 adds 16 random bits
    below its mantissa to the fp32 bit pattern and truncates (the carry rounds up with exactly that
    probability); e4m3 does the same with 20 bits where it is normal and ``floor`` on its uniform
    2^-9 grid below 2^-5. fp16 takes the general path (`_general_`), the tests' reference."""
    if rounded.dtype == torch.int8:
        u = torch.rand(target.shape, generator=generator, device=target.device)
        rounded.copy_(torch.floor(target.float() + u).clamp_(-127, 127))
    elif rounded.dtype == torch.bfloat16:
        rounded.copy_(_truncate_with_carry(target.float(), 16, generator))
    elif rounded.dtype == torch.float8_e4m3fn:
        y = target.float()
        normal = _truncate_with_carry(y, 20, generator)
        u = torch.rand(y.shape, generator=generator, device=y.device)
        uniform = torch.floor(y * 512.0 + u).div_(512.0)  # exact: the grid step is 2^-9 there
        rounded.copy_(torch.where(y.abs() < 2.0**-5, uniform, normal))
    elif rounded.dtype in FLOAT_GRIDS:
        _general_(rounded, target, generator)
    else:
        raise TypeError(f"stochastic rounding to {rounded.dtype} is not supported")
    return rounded


def _truncate_with_carry(y: torch.Tensor, bits: int, generator: torch.Generator) -> torch.Tensor:
    """fp32 `y` with its lowest `bits` mantissa bits cleared after adding a uniform random integer
    below 2^bits: rounds the magnitude up with probability (dropped bits) / 2^bits (sign-magnitude,
    so away from zero for negative values too). Finite inputs below the grid's largest value."""
    noise = torch.randint(
        0, 2**bits, y.shape, generator=generator, device=y.device, dtype=torch.int32
    )
    return ((y.view(torch.int32) + noise) & -(2**bits)).view(torch.float32)


def _general_(rounded: torch.Tensor, target: torch.Tensor, generator: torch.Generator) -> None:
    """Any float grid of `FLOAT_GRIDS`: the neighbour on the other side of `target` found on the bit
    pattern, taken with probability |target - rounded| / |neighbour - rounded|."""
    near = rounded.to(torch.float32)
    gap = target.to(torch.float32) - near
    other = _other_neighbour(rounded, gap > 0)
    step = other - near
    probability = torch.where(
        (gap != 0) & torch.isfinite(other) & (step != 0), gap / step, torch.zeros_like(gap)
    )
    draw = torch.rand(target.shape, generator=generator, device=target.device)
    rounded.copy_(torch.where(draw < probability, other, near).to(rounded.dtype))


def round_to_dtype(
    x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None
) -> torch.Tensor:
    """`x` in `dtype`: nearest without a generator, else stochastically rounded (an fp32 or wider
    `x` to bf16 / fp16); an `x` already in `dtype`, or a `dtype` as wide as fp32, is cast as is."""
    rounded = x.to(dtype)
    if generator is None or dtype not in FLOAT_GRIDS or x.dtype == dtype:
        return rounded
    return stochastic_round_(rounded, x.to(torch.float32), generator)


def _scale_grid(scale: torch.Tensor, shape: torch.Size, scheme: QuantScheme) -> torch.Tensor:
    """The per-element scale of a weight of `shape`, broadcastable: [] / [N, 1] / blocks expanded."""
    if scheme.weight_granularity != "block":
        return scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    bn, bk = scheme.block_size
    grid = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return grid[: shape[0], : shape[1]]


def stochastic_codes_(
    codes: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scheme: QuantScheme,
    generator: torch.Generator,
) -> torch.Tensor:
    """Re-round `codes`, the nearest codes of `weight` under `scale` (as `quantize_weight` wrote
    them), stochastically: ``E[codes * scale] = weight`` for every weight inside the clamp range.
    The target ``clamp(weight / scale)`` uses the quantizer's own division rule."""
    qmax = 127.0 if scheme.code_dtype == torch.int8 else 448.0
    target = weight.to(torch.float32) / _scale_grid(scale, weight.shape, scheme)
    return stochastic_round_(codes, target.clamp_(-qmax, qmax), generator)
