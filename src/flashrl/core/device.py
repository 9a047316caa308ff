"""Device and dtype choice, and peak memory: one definition for the engine, trainer and tools."""

from __future__ import annotations

import resource

import torch

from flashrl.errors import ConfigError, UnsupportedError

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
"""Activation dtypes by name."""


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A dtype name of `DTYPES` or a torch dtype; None means bfloat16."""
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device`, or CUDA when available and else the CPU. A device name torch does not know is a
    `ConfigError`; a CUDA device this machine does not have an `UnsupportedError`."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device={device!r} is invalid; allowed: cpu, cuda, cuda:N") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            built = "without" if torch.version.cuda is None else "with"
            raise UnsupportedError(
                f"device={device!r}: CUDA is not available on this machine "
                f"(torch {torch.__version__}, built {built} CUDA); "
                "available: cpu"
            )
        if resolved.index is not None and resolved.index >= count:
            cudas = ", ".join(f"cuda:{i}" for i in range(count))
            raise UnsupportedError(
                f"device={device!r}: CUDA is available with {count} device(s); "
                f"available: cpu, {cudas}"
            )
    elif resolved.type != "cpu":
        raise UnsupportedError(f"device={device!r}: the engine runs on cpu or cuda")
    return resolved


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
