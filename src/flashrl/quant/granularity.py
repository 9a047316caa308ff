"""The scale layout of one quantized [N, K] weight made of row shards, and its in-place requantization.

`QuantLinear` holds one such weight; `QuantExperts` holds E of them stacked along a leading expert
dimension and hands each expert's slices (``weight[e]``, ``weight_scale[e]``, ``row_scale[e]``)
to the same `WeightLayout`, so expert e's codes and scales are those of a `QuantLinear` with the
same shards loaded from expert e's weight.

Fused layers (q/k/v -> qkv, gate/up -> gate_up) are built from *shards*, one per checkpoint tensor.
Each shard is quantized on its own: per-channel schemes are row-local anyway; the per-tensor scheme
keeps one scale per shard (like a pre-quantized FP8 checkpoint, unlike vLLM's online per-tensor,
which takes one amax over the fused weight); the block scheme gives each shard its own block grid.
So a shard that arrives alone (q without k and v) is re-quantized exactly as a fresh load of the
whole layer would quantize it, and the other shards keep their codes. For real models, whose shard
sizes are multiples of 128, the per-shard block grid is the ordinary 128x128 grid.

Scale buffer (fp32) per weight granularity: ``tensor`` [S] (one per shard), ``channel`` [N, 1],
``block`` [sum_i ceil(n_i/bn), ceil(K/bk)]. A per-tensor weight of several shards also keeps a
``row_scale`` [N] (each shard's scale repeated over its rows): the GEMM takes one scale per row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from flashrl.quant.dispatch import quantize_weight
from flashrl.quant.primitives import dequantize_per_block_shards, dequantize_per_row
from flashrl.quant.schemes import QuantScheme
from flashrl.quant.stochastic import stochastic_codes_


def check_shard_sizes(shard_sizes: Iterable[int] | None, out_features: int) -> tuple[int, ...]:
    """`shard_sizes` as a tuple (None: one shard of `out_features` rows), checked to be positive
    and to add up to `out_features`."""
    shards = tuple(int(s) for s in (shard_sizes or (out_features,)))
    if sum(shards) != out_features or min(shards) <= 0:
        raise ValueError(
            f"shard_sizes {shards} must be positive and sum to out_features={out_features}"
        )
    return shards


def shard_rows(shard_sizes: tuple[int, ...], shard: int) -> tuple[int, int]:
    """Row range [start, end) of shard `shard` in the fused weight."""
    if not 0 <= shard < len(shard_sizes):
        raise IndexError(f"shard {shard} out of range for a layer with {len(shard_sizes)} shard(s)")
    start = sum(shard_sizes[:shard])
    return start, start + shard_sizes[shard]


def changed_codes(old: torch.Tensor, new: torch.Tensor) -> int:
    """How many codes differ, compared bit for bit (an fp8 NaN pattern counts as itself)."""
    return int((old.view(torch.uint8) != new.view(torch.uint8)).sum())


@dataclass(frozen=True)
class WeightLayout:
    """Scale shapes and shard slices of one [N, K] weight quantized with `scheme`."""

    scheme: QuantScheme
    in_features: int
    shard_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.shard_sizes)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Shape of the fp32 ``weight_scale`` buffer (module docstring)."""
        g = self.scheme.weight_granularity
        if g == "tensor":
            return (len(self.shard_sizes),)
        if g == "channel":
            return (self.out_features, 1)
        bn, bk = self.scheme.block_size
        return (sum(math.ceil(n / bn) for n in self.shard_sizes), math.ceil(self.in_features / bk))

    @property
    def has_row_scale(self) -> bool:
        """Whether the GEMM needs a ``row_scale`` [N]: per tensor over several shards."""
        return self.scheme.weight_granularity == "tensor" and len(self.shard_sizes) > 1

    def shard_scale(self, scale: torch.Tensor, shard: int) -> torch.Tensor:
        """The view of `scale` (a ``weight_scale``) that holds shard `shard`'s scales."""
        g = self.scheme.weight_granularity
        if g == "tensor":
            return scale[shard]
        start, end = shard_rows(self.shard_sizes, shard)
        if g == "channel":
            return scale[start:end]
        bn = self.scheme.block_size[0]
        first = sum(math.ceil(n / bn) for n in self.shard_sizes[:shard])
        return scale[first : first + math.ceil(self.shard_sizes[shard] / bn)]

    def requantize_(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        row_scale: torch.Tensor | None,
        weight: torch.Tensor,
        shard: int | None = None,
        generator: torch.Generator | None = None,
        name: str = "weight",
    ) -> None:
        """Quantize `weight` (the whole [N, K], or shard `shard`'s rows) into `codes` and `scale`
        in place, with fresh scales; `row_scale` follows. With a `generator` the codes are then
        rounded stochastically (`flashrl.quant.stochastic`). `name` labels errors."""
        if self.scheme.weight_granularity == "channel" and shard is None:
            # per-channel scales are row-local: every shard in one call, the same bits
            quantize_weight(weight, self.scheme, out=codes, scale_out=scale, name=name)
            if generator is not None:
                stochastic_codes_(codes, weight, scale, self.scheme, generator)
            return
        shards = range(len(self.shard_sizes)) if shard is None else [shard]
        base = 0 if shard is None else shard_rows(self.shard_sizes, shard)[0]
        for i in shards:
            start, end = shard_rows(self.shard_sizes, i)
            local, shard_codes = weight[start - base : end - base], codes[start:end]
            shard_scale = self.shard_scale(scale, i)
            label = f"{name} shard {i}" if len(self.shard_sizes) > 1 else name
            quantize_weight(local, self.scheme, out=shard_codes, scale_out=shard_scale, name=label)
            if generator is not None:
                stochastic_codes_(shard_codes, local, shard_scale, self.scheme, generator)
            if row_scale is not None:
                row_scale[start:end].copy_(scale[i].expand(end - start))

    def dequantize(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        row_scale: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The [N, K] weight `codes` stand for: codes times their scales, in `dtype`."""
        if self.scheme.weight_granularity == "block":
            return dequantize_per_block_shards(
                codes, scale, self.scheme.block_size, self.shard_sizes, dtype
            )
        scale = gemm_scale(scale, row_scale)
        return dequantize_per_row(codes, scale.reshape(-1, 1) if scale.dim() else scale, dtype)


def gemm_scale(scale: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
    """The weight scale as `dispatch.scaled_linear` takes it: one per row for a fused per-tensor
    weight, else the ``weight_scale`` buffer itself."""
    return row_scale if row_scale is not None else scale
