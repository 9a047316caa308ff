"""The weight-update phase: the trainer's updated parameters into the rollout backend (in-process)
or broadcast to the rollout workers, which re-quantize in place with fresh scales
(`flashrl.distributed.rollouts`; docs/architecture.md, "One weight update")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WeightUpdate:
    metrics: dict[str, float]
    """``weight_update/sent_bytes`` (workers), ``weight_update/*_changed_frac`` and
    ``weight_update/delta_*``."""
    times: dict[str, float]
    """Seconds: ``weight_update_s`` (the whole call), then the rollout source's own parts
    (``transfer_s``, ``requantize_s``, ``kv_calibration_s``, per-worker
    ``worker<i>/weight_update_s``)."""


def update_rollout_weights(rollouts: Any, policy: torch.nn.Module) -> WeightUpdate:
    """Send `policy`'s parameters to `rollouts` (a `LocalRollouts` or `PoolRollouts`) and split
    its stats into metrics and times."""
    start = time.perf_counter()
    stats = rollouts.update_weights(policy.named_parameters())
    times = {"weight_update_s": time.perf_counter() - start}
    metrics = {}
    if "sent_bytes" in stats:
        metrics["weight_update/sent_bytes"] = stats.pop("sent_bytes")
    for key in [k for k in stats if k.endswith("_changed_frac") or k.startswith("delta_")]:
        metrics[f"weight_update/{key}"] = stats.pop(key)
    times.update(stats)
    return WeightUpdate(metrics, times)
