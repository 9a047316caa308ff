"""The sync phase: the trainer's updated parameters into the rollout backend (in-process) or
broadcast to the rollout workers, which re-quantize in place with fresh scales
(`flashrl.distributed.rollouts`; docs/architecture.md, "One weight update")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Synced:
    metrics: dict[str, float]
    """``sync/bytes_sent`` (workers), ``sync/*_changed_frac`` and ``sync/delta_*``."""
    times: dict[str, float]
    """Seconds: ``sync_total`` (the whole call), then the rollout source's own parts (``sync``,
    ``requant``, ``kv_calibration``, per-worker ``sync/worker<i>``)."""


def sync(rollouts: Any, policy: torch.nn.Module) -> Synced:
    """Send `policy`'s parameters to `rollouts` (a `LocalRollouts` or `PoolRollouts`) and split
    its stats into metrics and times."""
    start = time.perf_counter()
    stats = rollouts.sync(policy.named_parameters())
    times = {"sync_total": time.perf_counter() - start}
    metrics = {}
    if "bytes" in stats:
        metrics["sync/bytes_sent"] = stats.pop("bytes")
    for key in [k for k in stats if k.endswith("_changed_frac") or k.startswith("delta_")]:
        metrics[f"sync/{key}"] = stats.pop(key)
    times.update(stats)
    return Synced(metrics, times)
