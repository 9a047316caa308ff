"""Joining Ray without hanging: `connect` and `check_resources`.

``ray.init(address=...)`` retries an unreachable address for minutes with nothing but log lines,
and an actor whose resources the cluster lacks (``num_gpus=1`` on a machine without a GPU) waits
forever to be placed. So, before any actor starts: the address is parsed (``auto``,
``host:port`` or ``ray://host:port``), a ``host:port`` is probed with one TCP connection within a
deadline, Ray's own connection errors are named, and the cluster's CPUs and GPUs are compared with
what the workers ask for. Each failure is a `ConfigError` naming ``rollout.workers.address`` or the
resource, with what is allowed.
"""

from __future__ import annotations

import socket
from typing import Any

from flashrl.errors import ConfigError, UnsupportedError

CONNECT_TIMEOUT_S = 30.0
"""The longest wait for a Ray address to answer (the pool's call timeout caps it further)."""

ADDRESS_FORMS = "'auto', host:port (e.g. 10.0.0.5:6379) or ray://host:port"


def parse_address(address: str) -> tuple[str, int] | None:
    """The (host, port) to probe of a Ray address; None for ``auto``. A malformed address is a
    `ConfigError` naming it and the accepted forms."""
    if address == "auto":
        return None
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal in brackets
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"rollout.workers.address={address!r} is not a Ray address; allowed: {ADDRESS_FORMS}, or "
            f"leave it unset to start a local Ray"
        )
    return host, int(port)


def connect(ray: Any, address: str | None, timeout_s: float, **kwargs: Any) -> None:
    """``ray.init`` at `address` (None: a local instance), failing within `timeout_s` (at most
    `CONNECT_TIMEOUT_S`) with a `ConfigError` naming the address when nothing answers there."""
    if address is not None:
        target = parse_address(address)
        wait = min(timeout_s, CONNECT_TIMEOUT_S)
        if target is not None:
            try:
                socket.create_connection(target, timeout=wait).close()
            except OSError as err:
                timed_out = isinstance(err, TimeoutError)
                reason = f"no answer within {wait:g} s" if timed_out else err.strerror or err
                raise ConfigError(
                    f"rollout.workers.address={address!r}: no Ray cluster answers there ({reason}); start one with 'ray start --head' and give its address "
                    f"({ADDRESS_FORMS}), or leave rollout.workers.address unset to start a local Ray"
                ) from None
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError, TimeoutError) as err:
        if address is None:
            raise
        raise ConfigError(
            f"rollout.workers.address={address!r}: Ray could not join the cluster there "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"allowed: {ADDRESS_FORMS}"
        ) from None


def check_resources(ray: Any, workers: int, cpus: float, gpus: float, address: str | None) -> None:
    """An `UnsupportedError` saying what is missing when the cluster has fewer CPUs or GPUs in all
    than `workers` actors of `cpus` and `gpus` each need (they would wait forever to be placed)."""
    total = ray.cluster_resources()
    where = "the local Ray" if address is None else f"the Ray cluster at {address}"
    for name, per_worker, flag in (("GPU", gpus, "gpus"), ("CPU", cpus, "cpus")):
        need, have = workers * per_worker, float(total.get(name, 0.0))
        if need > have:
            raise UnsupportedError(
                f"rollout.workers.count={workers} x rollout.workers.{flag}={per_worker:g} needs "
                f"{need:g} {name}(s), but {where} has {have:g}; lower rollout.workers.{flag} "
                f"(rollout.workers.gpus=0 runs the workers on CPU) or add {name}s to the cluster"
            )
