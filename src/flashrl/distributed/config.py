"""`WorkersConfig`: the rollout workers on Ray and how weights reach them.

One dataclass, two readers: it is the ``rollout.workers`` group of `flashrl train`
(``--rollout.workers.count 2``) and the config `flashrl.distributed.pool.WorkerPool` runs with,
the same object, never a copy. It imports neither Ray nor torch, so the training config can hold
it. Every field is checked when it is built; errors name the ``rollout.workers.`` field, the value
and what is allowed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields

from flashrl.errors import ConfigError

PAYLOADS = ("stream", "codes", "delta")
"""What a weight update sends (`flashrl.distributed.transport`)."""
MAX_TIMEOUT_S = 1e7
"""The longest `WorkersConfig.timeout` (about 115 days): larger values overflow the timeouts of
`datetime.timedelta`, sockets and Ray."""
PREFIX = "rollout.workers."
_ADDRESS = re.compile(r"auto|local|(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")
"""What Ray's ``init(address=...)`` takes: 'auto', 'local', host:port (IPv6 in brackets), ray://..."""


@dataclass(frozen=True)
class WorkersConfig:
    """How many rollout workers (Ray actors), where, with what resources, how weights travel."""

    count: int = 0
    """Rollout workers as Ray actors (needs flashrl[ray]); 0 generates in the trainer's process.
    docs/distributed.md."""
    address: str | None = None
    """None starts a local Ray instance; 'auto' or host:port joins a running cluster."""
    cpus: float = 1.0
    """Ray CPUs reserved per rollout worker."""
    gpus: float = 0.0
    """Ray GPUs per rollout worker (> 0: its engine runs on cuda)."""
    threads: int = 1
    """torch threads per rollout worker."""
    payload: str = "stream"
    """'stream': send the trainer's weights, workers re-quantize; 'codes': quantize once on the
    trainer, send codes + scales (identical codes, about half the bytes of bf16); 'delta': codes
    with scale hysteresis, only the changed ones sent, checksummed (docs/distributed.md)."""
    delta_scale_band: float = 0.05
    """'delta': a row keeps its scale while its amax stays within [(1 - band) * amax at its last
    fresh scale, that amax]; 0: fresh scales at every update (the 'codes' bits)."""
    delta_full_every: int = 20
    """'delta': every N-th update sends all codes (0: only the first update and checksum repairs)."""
    bucket_mb: float = 64.0
    """MiB per broadcast bucket (the peak extra memory of an update)."""
    timeout: float = 600.0
    """Seconds a worker may take for one call (generate, weight update) before the run stops naming it."""
    async_rollouts: bool = False
    """Generate step t+1 while step t trains (rollouts one step stale; needs count >= 1)."""

    def __post_init__(self) -> None:
        _integer(self, "count", 0, "0: generate in the trainer's process")
        _integer(self, "threads", 1, "torch threads per worker")
        _integer(self, "delta_full_every", 0, "0: only the first update and repairs")
        for name, (ok, allowed) in _RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{PREFIX}{name}={value!r} is not a number; allowed: {allowed}")
            if not math.isfinite(value) or not ok(value):
                why = "is out of range" if math.isfinite(value) else "is not a finite number"
                raise ConfigError(f"{PREFIX}{name}={value!r} {why}; allowed: {allowed}")
        if self.payload not in PAYLOADS:
            raise ConfigError(
                f"{PREFIX}payload={self.payload!r} is invalid; allowed: {', '.join(PAYLOADS)}"
            )
        if self.address is not None and not (
            isinstance(self.address, str) and _ADDRESS.fullmatch(self.address)
        ):
            raise ConfigError(
                f"{PREFIX}address={self.address!r} is invalid; allowed: none (a local Ray), "
                f"'auto', 'local', host:port or ray://host:port"
            )
        if self.async_rollouts and self.count < 1:
            raise ConfigError(f"{PREFIX}async_rollouts needs {PREFIX}count >= 1")
        unused = [f.name for f in fields(self) if getattr(self, f.name) != f.default]
        if self.count == 0 and unused != ["count"] and unused:
            names = ", ".join(f"{PREFIX}{n}={getattr(self, n)!r}" for n in unused)
            raise ConfigError(
                f"{names}: no effect without rollout workers ({PREFIX}count=0 generates in the "
                f"trainer's process); set {PREFIX}count >= 1 or drop them"
            )

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes."""
        return max(1, int(self.bucket_mb * 2**20))


def _integer(config: WorkersConfig, name: str, least: int, note: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(
            f"{PREFIX}{name}={value!r} is invalid; allowed: an integer >= {least} ({note})"
        )


_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "cpus": (lambda v: v >= 0, "a number >= 0 (Ray CPUs per rollout worker)"),
    "gpus": (lambda v: v >= 0, "a number >= 0 (Ray GPUs per rollout worker; 0: CPU)"),
    "bucket_mb": (lambda v: v > 0, "a number of MiB > 0"),
    "timeout": (lambda v: 0 < v <= MAX_TIMEOUT_S, f"seconds > 0 and <= {MAX_TIMEOUT_S:g}"),
    "delta_scale_band": (lambda v: 0 <= v < 1, "a number >= 0 and < 1 (0: fresh scales)"),
}
"""The float fields: their range and what is allowed, as the errors say it."""
