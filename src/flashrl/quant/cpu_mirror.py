"""fp32 copies of CPU weights for the CPU GEMMs, rebuilt whenever the weight is written.

No CPU here multiplies int8 (without VNNI/AMX), fp8 or, without AVX512-BF16/AMX, bf16 natively, so
the CPU paths (`flashrl.quant.gemm`, `flashrl.quant.linear.DenseLinear`) multiply the fp32 values
of the codes. Converting the weight on every call costs more than the matmul at decode batch sizes:
at SmolLM2-135M's shapes and batch 16, 8x the GEMM with the converted weight for fp8's table
decode, 3x for int8's and bf16's casts (benchmarks/RESULTS.md, "CPU weight mirror"). A
`Fp32Mirror` keeps the converted values: the same fp32 numbers the conversion gives, so every
output stays bit for bit what it was.

Staleness: the mirror is rebuilt when the source (or another tensor the conversion reads, such as
fp8_block's scales) is another tensor object, its storage moved, or torch's version counter of it
changed. Every in-place write (``copy_``, ``out=``, indexing, a
view's write) bumps that counter; a write through ``.data`` does not, and nothing in the built-in
engine writes weights that way (tested: requantize, updates, smoothing refresh, stochastic
rounding). While torch.compile traces, the conversion runs inline instead.

Memory: 4 bytes per mirrored weight. The engine gives each model a budget
(`enable_mirrors`, `DEFAULT_BUDGET_FRACTION` of physical memory); layers past it convert per call.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

DEFAULT_BUDGET_FRACTION = 0.25
"""Mirrors of one model may take at most this fraction of physical memory."""


class Fp32Mirror:
    """The fp32 values of one CPU weight tensor, kept until the tensor is written."""

    __slots__ = ("_key", "_sources", "_value", "enabled")

    def __init__(self) -> None:
        self.enabled = False
        self._sources: tuple[torch.Tensor, ...] = ()
        self._key: tuple[tuple[int, int], ...] = ()
        self._value: torch.Tensor | None = None

    def get(
        self,
        source: torch.Tensor,
        convert: Callable[[torch.Tensor], torch.Tensor],
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        """``convert(source)``, from the mirror when it is enabled and current. `inputs` are the
        other tensors `convert` reads (fp8_block's scales): a write to any of them rebuilds too."""
        if not self.enabled or source.device.type != "cpu" or torch.compiler.is_compiling():
            return convert(source)
        tensors = (source, *inputs)
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        same = len(self._sources) == len(tensors) and all(
            a is b for a, b in zip(self._sources, tensors)
        )
        if not same or self._key != key or self._value is None:
            self._value = convert(source)
            self._sources, self._key = tensors, key
        return self._value

    def clear(self) -> None:
        self._sources, self._value = (), None

    @property
    def nbytes(self) -> int:
        return 0 if self._value is None else self._value.numel() * self._value.element_size()


def physical_memory_bytes() -> int:
    """Total physical memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_budget_bytes(engines: int = 1) -> int:
    """One engine's share of `DEFAULT_BUDGET_FRACTION` of physical memory when `engines` engines
    share the machine (the Ray rollout workers of a run)."""
    return int(DEFAULT_BUDGET_FRACTION * physical_memory_bytes()) // engines


def enable_mirrors(model: nn.Module, budget_bytes: int | None = None) -> int:
    """Enable the fp32 mirror of every CPU layer of `model` that has one (``fp32_mirror``), in module
    order, while their total fits `budget_bytes` (default: `DEFAULT_BUDGET_FRACTION` of physical
    memory). Returns the bytes the mirrors will take."""
    if budget_bytes is None:
        budget_bytes = default_budget_bytes()
    total = 0
    for module in model.modules():
        mirror = getattr(module, "fp32_mirror", None)
        weight = getattr(module, "weight", None)
        if not isinstance(mirror, Fp32Mirror) or weight is None or weight.device.type != "cpu":
            continue
        size = weight.numel() * 4
        mirror.enabled = total + size <= budget_bytes
        if mirror.enabled:
            total += size
        else:
            mirror.clear()
    return total
