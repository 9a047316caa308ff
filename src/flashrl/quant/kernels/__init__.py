"""Triton kernels for the GPU quantization paths: the switch that picks them, and their loader.

`requant` holds fused kernels whose codes and scales are bit-identical to the reference quantizer in
`flashrl.quant.primitives` (same math, not an approximation), for every granularity: per row
(per-channel weights, per-token activations), per tensor, 128x128 blocks and 1x128 groups; `launch`
holds their host side, one function per granularity with the reference's signature. The dispatch
table `flashrl.quant.dispatch.QUANTIZERS` (so `QuantLinear.requantize_` and every GEMM) asks
`use_triton(x)` which of the two to run:

- ``FLASHRL_QUANT_KERNELS=auto`` (default): Triton for CUDA tensors when `triton` imports, else the
  torch reference. The choice is logged once per device type at INFO.
- ``FLASHRL_QUANT_KERNELS=triton``: always the kernels; raises where they cannot run (no triton, or
  a CPU tensor without ``TRITON_INTERPRET=1``). Never silently switches.
- ``FLASHRL_QUANT_KERNELS=torch``: always the torch reference.

`set_mode` / `mode_scope` override the environment in-process (tests, benchmarks).

Where kernels run: CUDA tensors run compiled kernels; CPU tensors run under the Triton interpreter,
which needs ``TRITON_INTERPRET=1`` in the environment at call time (Triton itself reads that
variable only when a ``@triton.jit`` decorator runs, so this package loads `requant` twice as needed,
once compiled and once interpreted, and picks per call: a GPU test session can run both).

`group_gemm` holds the GEMM of the `int8_g*` schemes (per-group activation scales, per-row weight
scales), loaded the same way; `launch.int8_group_gemm` is its host side and
`flashrl.quant.gemm.int8_group_cuda` picks it with `use_triton`, like the quantizers.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from flashrl.errors import ConfigError, UnsupportedError

logger = logging.getLogger(__name__)

ENV_VAR = "FLASHRL_QUANT_KERNELS"
MODES = ("auto", "triton", "torch")

_override: str | None = None
_logged: set[tuple[str, str, str]] = set()
_triton_found: bool | None = None


class KernelsUnavailableError(UnsupportedError, RuntimeError):
    """The Triton kernels were asked for but cannot run here (also a RuntimeError, as before)."""


def triton_available() -> bool:
    """Whether the `triton` package is installed (checked once, without importing it)."""
    global _triton_found
    if _triton_found is None:
        _triton_found = importlib.util.find_spec("triton") is not None
    return _triton_found


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value (Triton's own spelling rules)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")


def get_mode() -> str:
    """The active mode: the in-process override, else ``FLASHRL_QUANT_KERNELS``, else ``auto``."""
    if _override is not None:
        return _override
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return "auto"
    if value not in MODES:
        raise ConfigError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a kernel mode; allowed: {', '.join(MODES)}"
        )
    return value


def set_mode(mode: str | None) -> None:
    """Override ``FLASHRL_QUANT_KERNELS`` in this process (None: back to the environment)."""
    global _override
    if mode is not None:
        mode = mode.strip().lower()
        if mode not in MODES:
            raise ConfigError(f"unknown kernel mode {mode!r}; allowed: {', '.join(MODES)}")
    _override = mode


@contextmanager
def mode_scope(mode: str | None) -> Iterator[None]:
    """`set_mode` for the duration of a ``with`` block."""
    previous = _override
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


def unsupported_reason(x: torch.Tensor) -> str | None:
    """Why the kernels cannot run on `x`, or None when they can."""
    if not triton_available():
        return "the triton package is not installed (pip install triton)"
    if x.is_cuda or interpreter_enabled():
        return None
    return (
        f"the tensor is on {x.device}: the kernels run on CUDA tensors, or on CPU tensors under the "
        f"Triton interpreter (TRITON_INTERPRET=1, used by the tests; not a performance path)"
    )


def use_triton(x: torch.Tensor) -> bool:
    """Whether quantizing `x` runs the Triton kernels (True) or the torch reference (False).

    Raises `KernelsUnavailableError` when the mode is ``triton`` and the kernels cannot run on `x`.
    """
    mode = get_mode()
    if mode == "torch":
        choice = False
    elif mode == "triton":
        reason = unsupported_reason(x)
        if reason is not None:
            raise KernelsUnavailableError(
                f"{ENV_VAR}=triton (or set_mode('triton')) but {reason}; use 'auto' or 'torch'"
            )
        choice = True
    else:
        choice = x.is_cuda and triton_available()
    key = (mode, x.device.type, "triton" if choice else "torch")
    if key not in _logged:
        _logged.add(key)
        logger.info(
            "quantization kernels on %s: %s (%s=%s)",
            x.device.type,
            "Triton" if choice else "torch reference",
            ENV_VAR,
            mode,
        )
    return choice


KERNEL_MODULES = ("requant", "group_gemm")
"""The files of ``@triton.jit`` kernels in this package, each loaded through `_load`."""


def _load(interpret: bool, source: str = "requant") -> ModuleType:
    """Kernel module `source` (`KERNEL_MODULES`) with its ``@triton.jit`` functions compiled
    (False) or interpreted (True)."""
    assert source in KERNEL_MODULES, source
    name = f"{__name__}._{source}_{'interpreted' if interpret else 'compiled'}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    import triton

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{source}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.4: the decorator reads knobs.runtime.interpret
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            spec.loader.exec_module(module)
    else:  # older triton reads the environment in the decorator
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            spec.loader.exec_module(module)
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved
    sys.modules[name] = module
    return module


def kernels_for(x: torch.Tensor, source: str = "requant") -> ModuleType:
    """The copy of kernel module `source` (`requant`, `group_gemm`) that runs on `x`: interpreted
    for CPU tensors or under TRITON_INTERPRET=1 (Triton's meaning of the variable), compiled
    otherwise. Raises where neither can run."""
    reason = unsupported_reason(x)
    if reason is not None:
        raise KernelsUnavailableError(f"Triton quantization kernels cannot run: {reason}")
    return _load(interpret=interpreter_enabled() or not x.is_cuda, source=source)


__all__ = [
    "ENV_VAR",
    "KERNEL_MODULES",
    "MODES",
    "get_mode",
    "interpreter_enabled",
    "kernels_for",
    "mode_scope",
    "set_mode",
    "triton_available",
    "unsupported_reason",
    "use_triton",
]
