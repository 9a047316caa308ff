"""`WorkersConfig`: the rollout workers on Ray and how weights reach them.

One dataclass, two readers: it is the ``rollout.workers`` group of `flashrl train`
(``--rollout.workers.count 2``) and the config `flashrl.distributed.pool.WorkerPool` runs with,
the same object, never a copy. It imports neither Ray nor torch, so the training config can hold
it. Every field is checked when it is built; errors name the ``rollout.workers.`` field, the value
and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from flashrl.core.fields import check_fields, choice, integer, number, setting
from flashrl.errors import ConfigError

PAYLOADS = ("stream", "codes", "delta")
"""What a weight sync sends (`flashrl.distributed.transport`)."""
MAX_TIMEOUT_S = 1e7
"""The longest `WorkersConfig.timeout` (about 115 days): larger values overflow the timeouts of
`datetime.timedelta`, sockets and Ray."""
PREFIX = "rollout.workers."
_ADDRESS = re.compile(r"auto|local|(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")
"""What Ray's ``init(address=...)`` takes: 'auto', 'local', host:port (IPv6 in brackets), ray://..."""


def _check_address(address: str | None) -> str | None:
    if address is None or (isinstance(address, str) and _ADDRESS.fullmatch(address)):
        return address
    raise ConfigError(
        f"{PREFIX}address={address!r} is invalid; allowed: none (a local Ray), 'auto', 'local', "
        f"host:port or ray://host:port"
    )


@dataclass(frozen=True)
class WorkersConfig:
    """How many rollout workers (Ray actors), where, with what resources, how weights travel."""

    count: int = integer(0, least=0, note="0: generate in the trainer's process", resume_free=True)
    """Rollout workers as Ray actors (needs flashrl[ray]); 0 generates in the trainer's process.
    docs/distributed.md."""
    address: str | None = setting(None, check=_check_address, resume_free=True)
    """None starts a local Ray instance; 'auto' or host:port joins a running cluster."""
    cpus: float = number(1.0, at_least=0, note="Ray CPUs per rollout worker", resume_free=True)
    """Ray CPUs reserved per rollout worker."""
    gpus: float = number(
        0.0, at_least=0, note="Ray GPUs per rollout worker; 0: CPU", resume_free=True
    )
    """Ray GPUs per rollout worker (> 0: its engine runs on cuda)."""
    threads: int = integer(1, note="torch threads per worker", resume_free=True)
    """torch threads per rollout worker."""
    payload: str = choice("stream", PAYLOADS, resume_free=True)
    """'stream': send the trainer's weights, workers re-quantize; 'codes': quantize once on the
    trainer, send codes + scales (identical codes, about half the bytes of bf16); 'delta': codes
    with scale hysteresis, only the changed ones sent, checksummed (docs/distributed.md)."""
    delta_scale_band: float = number(0.05, at_least=0, below=1, note="0: fresh scales")
    """'delta': a row keeps its scale while its amax stays within [(1 - band) * amax at its last
    fresh scale, that amax]; 0: fresh scales at every update (the 'codes' bits)."""
    delta_full_every: int = integer(
        20, least=0, note="0: only the first update and repairs", resume_free=True
    )
    """'delta': every N-th update sends all codes (0: only the first update and checksum repairs)."""
    bucket_mb: float = number(64.0, above=0, unit="a number of MiB", resume_free=True)
    """MiB per broadcast bucket (the peak extra memory of an update)."""
    timeout: float = number(600.0, above=0, at_most=MAX_TIMEOUT_S, unit="seconds", resume_free=True)
    """Seconds a worker may take for one call (generate, weight update) before the run stops naming it."""
    async_rollouts: bool = False
    """Generate step t+1 while step t trains (rollouts one step stale; needs count >= 1)."""

    def __post_init__(self) -> None:
        check_fields(self, PREFIX)
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
