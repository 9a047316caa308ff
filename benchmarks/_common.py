"""Shared helpers for benchmark scripts: timing and JSON output (tables and device names come from
`flashrl.utils`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flashrl.utils import device_name, format_table, synchronize

__all__ = ["device_name", "format_table", "time_fn", "write_json"]


def time_fn(
    fn: Callable[[], object], device: torch.device, warmup: int = 2, repeat: int = 5
) -> float:
    """Median wall time of `fn` in seconds, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path
