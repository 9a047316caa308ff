"""Stacked expert weights of an MoE layer, quantized per expert, re-quantized in place.

Public API (small on purpose; the vLLM backend may reuse it):

- `QuantExperts(num_experts, in_features, out_features, scheme, shard_sizes)`: codes ``weight``
  [E, N, K] and fp32 ``weight_scale`` stacked per expert: [E, S] per tensor (one scale per expert
  and shard), [E, N, 1] per channel, [E, sum_i ceil(n_i/128), ceil(K/128)] per block (a block grid
  per expert and shard). Expert e's codes and scales are bit-identical to a `QuantLinear` with the
  same shards loaded from expert e's weight (tests/test_moe_experts.py): both hand their slices to
  the same `flashrl.quant.granularity.WeightLayout`.
- `DenseExperts`: the same API in the activation dtype (bf16 scheme, or experts kept unquantized).
- `make_experts(...)`: one or the other for a scheme.
- ``requantize_(w, expert=None, shard=None)``: `w` is [E, n, K] (every expert; the fused 3-D
  parameters of a `transformers` 5.x model) or [n, K] (one expert, a checkpoint tensor); `shard`
  picks gate or up of a fused gate/up weight. Storage never moves (`data_ptr` stays).
- ``linear(x, expert)``: ``x @ W_e^T`` with the same GEMM as `QuantLinear` (`quant.dispatch`);
  ``linear_prequantized(xq, x_scale, expert, dtype)``: the same from per-token activation codes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashrl.errors import InputError
from flashrl.quant.dispatch import prequantized_linear, scaled_linear
from flashrl.quant.encode import check_float_input
from flashrl.quant.gemm import check_gemm_shape
from flashrl.quant.granularity import (
    WeightLayout,
    changed_codes,
    check_shard_sizes,
    gemm_scale,
    shard_rows,
)
from flashrl.quant.schemes import QuantScheme, get_scheme


class _StackedExperts(nn.Module):
    """Shape bookkeeping and argument checks shared by `QuantExperts` and `DenseExperts`."""

    weight: torch.Tensor

    def _init_shape(self, num_experts: int, k: int, n: int, shards: Iterable[int] | None) -> None:
        self.num_experts, self.in_features, self.out_features = num_experts, k, n
        self.shard_sizes = check_shard_sizes(shards, n)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """Row range [start, end) of shard `shard` in one expert's weight."""
        return shard_rows(self.shard_sizes, shard)

    def update_shape(self, expert: int | None, shard: int | None) -> tuple[int, ...]:
        """The shape `requantize_` takes for (`expert`, `shard`); None means all of them."""
        start, end = (0, self.out_features) if shard is None else self.shard_rows(shard)
        rows = (end - start, self.in_features)
        return rows if expert is not None else (self.num_experts, *rows)

    def _check_update(self, weight: torch.Tensor, expert: int | None, shard: int | None) -> None:
        check_float_input(weight, "expert weight", ndim=None)
        if expert is not None and not 0 <= expert < self.num_experts:
            raise InputError(f"expert {expert} out of range [0, {self.num_experts})")
        expected = self.update_shape(expert, shard)
        if tuple(weight.shape) != expected:
            raise InputError(f"expert weight has shape {tuple(weight.shape)}; expected {expected}")

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in [*self.buffers(), *self.parameters()])


class QuantExperts(_StackedExperts):
    """E experts' [N, K] weights of one projection as 8-bit codes with per-expert scales."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        scheme: str | QuantScheme,
        shard_sizes: Iterable[int] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        scheme = get_scheme(scheme)
        if not scheme.is_quantized:
            raise ValueError(f"scheme {scheme.name!r} does not quantize; use DenseExperts")
        self._init_shape(num_experts, in_features, out_features, shard_sizes)
        device = torch.device(device) if device is not None else torch.device("cpu")
        check_gemm_shape(scheme, in_features, out_features, device)
        self.scheme, self.dtype = scheme, dtype
        self.layout = WeightLayout(scheme, in_features, self.shard_sizes)
        e, n, k = num_experts, out_features, in_features
        self.register_buffer("weight", torch.zeros(e, n, k, dtype=scheme.code_dtype, device=device))
        self.register_buffer("weight_scale", torch.ones(e, *self.layout.scale_shape, device=device))
        self.row_scale: torch.Tensor | None
        if self.layout.has_row_scale:  # the GEMM takes one scale per row
            self.register_buffer("row_scale", torch.ones(e, n, device=device), persistent=False)
        else:
            self.row_scale = None

    @torch.no_grad()
    def requantize_(
        self,
        weight: torch.Tensor,
        expert: int | None = None,
        shard: int | None = None,
        count_changed: bool = False,
    ) -> int:
        """Quantize `weight` into the existing buffers with fresh scales (module docstring);
        returns how many codes changed when `count_changed`, else 0."""
        self._check_update(weight, expert, shard)
        weight = weight.to(self.weight.device)
        start, end = (0, self.out_features) if shard is None else self.shard_rows(shard)
        target = self.weight[:, start:end] if expert is None else self.weight[expert, start:end]
        old = target.clone() if count_changed else None
        if self.scheme.weight_granularity == "channel" and shard is None:
            # per-channel scales are row-local: every expert's rows in one call, the same bits
            scales = self.weight_scale if expert is None else self.weight_scale[expert]
            rows = (-1, self.in_features)
            flat = (target.reshape(rows), scales.view(-1, 1), None, weight.reshape(rows))
            self.layout.requantize_(*flat, name="expert weight")
        else:
            for e in range(self.num_experts) if expert is None else [expert]:
                local = weight[e] if expert is None else weight
                self.layout.requantize_(
                    *self.expert_buffers(e), local, shard, name=f"expert {e} weight"
                )
        return 0 if old is None else changed_codes(old, target)

    def expert_buffers(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Views of expert `expert`'s codes, ``weight_scale`` and ``row_scale``: one weight of
        `self.layout`, laid out as a `QuantLinear`'s buffers."""
        row_scale = None if self.row_scale is None else self.row_scale[expert]
        return self.weight[expert], self.weight_scale[expert], row_scale

    def expert_scale(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s scale as `scaled_linear` takes it (one per row for a fused
        per-tensor layer)."""
        _, scale, row_scale = self.expert_buffers(expert)
        return gemm_scale(scale, row_scale)

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``x @ W_e^T`` for x [M, K], through the same GEMM as `QuantLinear.forward`."""
        return scaled_linear(
            x,
            self.weight[expert],
            self.expert_scale(expert),
            self.scheme,
            None,
            x.dtype,
            self.shard_sizes,
        )

    def linear_prequantized(
        self, xq: torch.Tensor, x_scale: torch.Tensor, expert: int, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """`linear` from per-token activation codes made beforehand (`prequantized_linear`): the
        same bits, one activation quantization for the rows of every expert."""
        return prequantized_linear(
            xq, x_scale, self.weight[expert], self.expert_scale(expert), self.scheme, out_dtype
        )

    def dequantized_weight(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight expert `expert` effectively multiplies by: codes times scales."""
        return self.layout.dequantize(*self.expert_buffers(expert), dtype)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, scheme={self.scheme.name}, "
            f"shards={self.shard_sizes}"
        )


class DenseExperts(_StackedExperts):
    """E experts' [N, K] weights in the activation dtype; "re-quantization" is an in-place copy."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        shard_sizes: Iterable[int] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._init_shape(num_experts, in_features, out_features, shard_sizes)
        self.scheme, self.dtype = get_scheme("bf16"), dtype
        shape = (num_experts, out_features, in_features)
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), False)

    @torch.no_grad()
    def requantize_(
        self,
        weight: torch.Tensor,
        expert: int | None = None,
        shard: int | None = None,
        count_changed: bool = False,
    ) -> int:
        """Copy `weight` (shapes as `QuantExperts.requantize_`) in place, cast to the dtype."""
        self._check_update(weight, expert, shard)
        start, end = (0, self.out_features) if shard is None else self.shard_rows(shard)
        target = self.weight[:, start:end] if expert is None else self.weight[expert, start:end]
        old = target.clone() if count_changed else None
        target.copy_(weight)
        return int((old != target).sum()) if old is not None else 0

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(x, self.weight[expert])

    def dequantized_weight(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight[expert].to(dtype)


def make_experts(
    num_experts: int,
    in_features: int,
    out_features: int,
    scheme: str | QuantScheme,
    shard_sizes: Iterable[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> QuantExperts | DenseExperts:
    """Empty stacked experts of `scheme` (loaded afterwards with `requantize_`)."""
    scheme = get_scheme(scheme)
    if scheme.is_quantized:
        return QuantExperts(
            num_experts, in_features, out_features, scheme, shard_sizes, dtype, device
        )
    return DenseExperts(num_experts, in_features, out_features, shard_sizes, dtype, device)
