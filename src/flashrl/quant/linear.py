"""`QuantLinear`: a linear layer with 8-bit weights that is re-quantized in place after every RL step.

Contract (numerics.md section 6): `requantize_(w)` computes fresh scales from `w` alone and writes
codes and scales into the *existing* buffers, so `data_ptr()` never changes and captured CUDA graphs
or compiled code stay valid.

Fused layers (q/k/v -> qkv, gate/up -> gate_up) are built from *shards*, one per checkpoint tensor,
each quantized on its own; the scale layout and the per-shard rules are `flashrl.quant.granularity`,
shared with `QuantExperts`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from flashrl.core.config import DEFAULT_SKIP
from flashrl.errors import InputError
from flashrl.quant.cpu_mirror import Fp32Mirror
from flashrl.quant.dispatch import scaled_linear
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
from flashrl.quant.smoothing import observe_and_scale
from flashrl.quant.stochastic import round_to_dtype


class _ShardedLinear:
    """Shard bookkeeping shared by `QuantLinear` and `DenseLinear` (fused q/k/v, gate/up)."""

    shard_sizes: tuple[int, ...]
    out_features: int
    bias: torch.Tensor | None

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """Row range [start, end) of shard `shard` in the fused weight."""
        return shard_rows(self.shard_sizes, shard)

    @torch.no_grad()
    def set_bias_(self, bias: torch.Tensor, shard: int | None = None) -> None:
        """Copy a new bias (full, or one shard's slice) into the bias in place."""
        if self.bias is None:
            raise ValueError("this layer was built without a bias")
        start, end = (0, self.out_features) if shard is None else self.shard_rows(shard)
        if tuple(bias.shape) != (end - start,):
            raise InputError(f"bias has shape {tuple(bias.shape)}; expected {(end - start,)}")
        self.bias[start:end].copy_(bias)


class QuantLinear(_ShardedLinear, nn.Module):
    """``y = x W^T + b`` with W stored as int8 / float8_e4m3fn codes plus fp32 scales.

    Buffers: ``weight`` [N, K] codes; ``weight_scale`` fp32 ([S] per-tensor with S shards, [N, 1]
    per-channel, [sum_i ceil(n_i/128), ceil(K/128)] per-block); ``bias`` [N] in the layer dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: str | QuantScheme,
        bias: bool = False,
        shard_sizes: Iterable[int] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        scheme = get_scheme(scheme)
        if not scheme.is_quantized:
            raise ValueError(
                f"scheme {scheme.name!r} does not quantize; keep the layer as nn.Linear"
            )
        shards = check_shard_sizes(shard_sizes, out_features)
        device = torch.device(device) if device is not None else torch.device("cpu")
        check_gemm_shape(scheme, in_features, out_features, device)
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.shard_sizes, self.dtype = scheme, shards, dtype
        self.layout = WeightLayout(scheme, in_features, shards)
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=scheme.code_dtype, device=device)
        )
        self.register_buffer(
            "weight_scale", torch.ones(self.layout.scale_shape, dtype=torch.float32, device=device)
        )
        # Per-tensor over several shards: the GEMM needs one scale per row, kept in its own buffer.
        self.row_scale: torch.Tensor | None
        if self.layout.has_row_scale:
            self.register_buffer(
                "row_scale",
                torch.ones(out_features, dtype=torch.float32, device=device),
                persistent=False,
            )
        else:
            self.row_scale = None
        self.bias: torch.Tensor | None
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        self.register_buffer("smooth", None)  # SmoothQuant factors: `flashrl.quant.smoothing`
        self.fp32_mirror = Fp32Mirror()  # CPU GEMMs: `flashrl.quant.cpu_mirror`

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, scheme: str | QuantScheme, shard_sizes: Iterable[int] | None = None
    ) -> QuantLinear:
        """Quantize an `nn.Linear` (its weight and bias are read, not modified)."""
        weight = linear.weight.detach()
        layer = cls(
            linear.in_features,
            linear.out_features,
            scheme,
            bias=linear.bias is not None,
            shard_sizes=shard_sizes,
            dtype=weight.dtype,
            device=weight.device,
        )
        layer.requantize_(weight)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer

    # ---------------------------------------------------------------- requantization

    @torch.no_grad()
    def requantize_(
        self,
        weight: torch.Tensor,
        shard: int | None = None,
        count_changed: bool = False,
        generator: torch.Generator | None = None,
    ) -> int:
        """Re-quantize in place from a new high-precision weight (the full [N, K], or one shard's rows).

        Scales are computed from `weight` only and overwrite the old ones. With a `generator` the
        codes are then rounded stochastically (`flashrl.quant.stochastic`: unbiased, so updates
        below half a code step survive on average). Returns the number of codes that changed when
        `count_changed` is set (a per-update diagnostic), else 0.
        """
        check_float_input(weight, "weight")
        rows = (0, self.out_features) if shard is None else self.shard_rows(shard)
        expected = (rows[1] - rows[0], self.in_features)
        if tuple(weight.shape) != expected:
            what = "weight" if shard is None else f"shard {shard} weight"
            raise InputError(f"{what} has shape {tuple(weight.shape)}; expected {expected}")
        weight = weight.to(self.weight.device)
        if self.smooth is not None:  # codes of W * s (fp32, as the quantizer computes anyway)
            weight = weight.float() * self.smooth
        old = self.weight[rows[0] : rows[1]].clone() if count_changed else None
        self.layout.requantize_(
            self.weight, self.weight_scale, self.row_scale, weight, shard, generator
        )
        return 0 if old is None else changed_codes(old, self.weight[rows[0] : rows[1]])

    # ---------------------------------------------------------------- compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = gemm_scale(self.weight_scale, self.row_scale)
        xs = x if self.smooth is None else observe_and_scale(self, x)
        return scaled_linear(
            xs, self.weight, scale, self.scheme, self.bias, x.dtype, self.shard_sizes,
            self.fp32_mirror,
        )  # fmt: skip

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer effectively multiplies by: codes times scales (over s, smoothed)."""
        w = self.layout.dequantize(self.weight, self.weight_scale, self.row_scale, dtype)
        return w if self.smooth is None else (w.float() / self.smooth).to(dtype)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        shards = f", shards={self.shard_sizes}" if len(self.shard_sizes) > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}{shards}, bias={self.bias is not None}"


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.float()


class DenseLinear(_ShardedLinear, nn.Linear):
    """The `bf16` scheme's linear layer (also used for layers kept in high precision): an `nn.Linear`
    with the same shard-aware in-place update API as `QuantLinear`, where "quantization" is a copy."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shard_sizes: Iterable[int] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.shard_sizes = tuple(int(s) for s in (shard_sizes or (out_features,)))
        if sum(self.shard_sizes) != out_features:
            raise ValueError(
                f"shard_sizes {self.shard_sizes} must sum to out_features={out_features}"
            )
        self.fp32_mirror = Fp32Mirror()  # CPU: `flashrl.quant.cpu_mirror`

    def reset_parameters(self) -> None:  # weights are always loaded; skip the random init
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T (+ b)``. On the CPU a bf16/fp16 layer multiplies in fp32 and rounds the output
        once, which is what a bf16 GEMM computes (exact products, fp32 accumulation, one rounding;
        only the order of the sum may differ): CPUs without bf16 dot-product units run torch's
        native bf16 GEMM 2-6x slower than this (benchmarks/RESULTS.md). The fp32 weight comes from
        the layer's mirror when the engine enabled it (`flashrl.quant.cpu_mirror`)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float16):
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        w32 = self.fp32_mirror.get(w, _float)
        return nn.functional.linear(x.float(), w32, bias).to(x.dtype)

    @torch.no_grad()
    def requantize_(
        self,
        weight: torch.Tensor,
        shard: int | None = None,
        count_changed: bool = False,
        generator: torch.Generator | None = None,
    ) -> int:
        """Copy a new weight (full, or one shard's rows) in place, cast to the layer dtype (rounded
        stochastically with a `generator`: `flashrl.quant.stochastic.round_to_dtype`)."""
        check_float_input(weight, "weight")
        start, end = (0, self.out_features) if shard is None else self.shard_rows(shard)
        if tuple(weight.shape) != (end - start, self.in_features):
            what = "weight" if shard is None else f"shard {shard} weight"
            raise InputError(
                f"{what} has shape {tuple(weight.shape)}; expected {(end - start, self.in_features)}"
            )
        target = self.weight[start:end]
        old = target.clone() if count_changed else None
        if generator is not None:  # else copy_ rounds to nearest as it casts, no temporary
            weight = round_to_dtype(weight.to(target.device), target.dtype, generator)
        target.copy_(weight)
        return int((old != target).sum()) if old is not None else 0


def make_linear(
    in_features: int,
    out_features: int,
    scheme: str | QuantScheme,
    bias: bool = False,
    shard_sizes: Iterable[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> QuantLinear | DenseLinear:
    """An empty linear layer of `scheme` (weights are loaded afterwards with `requantize_`)."""
    scheme = get_scheme(scheme)
    if scheme.is_quantized:
        return QuantLinear(in_features, out_features, scheme, bias, shard_sizes, dtype, device)
    return DenseLinear(in_features, out_features, bias, shard_sizes, dtype, device)


# -------------------------------------------------------------------- model-level API


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """Whether module name `name` matches a skip pattern: a glob (``"lm_head"``, ``"*.down_proj"``,
    also matched against any dotted suffix) or a regex prefixed with ``"re:"``."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.search(pattern[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return True
    return False


@dataclass
class QuantReport:
    """What `quantize_` did: which layers, and the model's parameter + buffer bytes before and after."""

    scheme: str
    quantized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def layers_quantized(self) -> int:
        return len(self.quantized)

    def __str__(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (
            f"quantize_({self.scheme}): {self.layers_quantized} linear layers quantized, "
            f"{len(self.skipped)} kept ({', '.join(self.skipped) or 'none'}); "
            f"model bytes {self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB ({ratio:.2f}x)"
        )


def model_nbytes(model: nn.Module) -> int:
    """Bytes of all distinct parameters and buffers (tied weights counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def quantize_(
    model: nn.Module, scheme: str | QuantScheme, skip: Iterable[str] = DEFAULT_SKIP
) -> QuantReport:
    """Replace every `nn.Linear` of `model` (except those matching `skip`) by a `QuantLinear`, in place.

    Layers are selected by type, not by name suffix; `skip` takes globs or ``"re:"`` regexes over
    qualified module names (default: `DEFAULT_SKIP`). Returns a `QuantReport`.
    """
    scheme = get_scheme(scheme)
    skip = tuple(skip)
    report = QuantReport(scheme=scheme.name, bytes_before=model_nbytes(model))
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        if not scheme.is_quantized or matches_any(name, skip):
            report.skipped.append(name)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(linear, scheme))
        report.quantized.append(name)
    report.bytes_after = model_nbytes(model)
    return report
