"""`WorkerPool`: the trainer's handle on N rollout workers (Ray actors) and their weight group.

Every remote call is waited for with a deadline (`WorkersConfig.timeout`), and a worker that died
or did not answer in time is named in a `RolloutWorkerError`; the gloo / NCCL group has the same
timeout, so a weight update to a dead worker fails instead of hanging. Ray is imported only here, lazily:
without it, `require_ray` raises an `UnsupportedError` with the one-line install hint.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from flashrl.core.rollout import Rollout, RolloutBackend
from flashrl.core.sampling import SamplingParams
from flashrl.distributed.cluster import check_resources, connect
from flashrl.distributed.config import WorkersConfig
from flashrl.distributed.delta import DeltaSender, delta_update
from flashrl.distributed.transport import (
    BucketBroadcast,
    free_port,
    make_group,
    payload_tensors,
    plan,
)
from flashrl.distributed.worker import RolloutWorker
from flashrl.errors import ConfigError, FlashRLError, UnsupportedError

logger = logging.getLogger(__name__)
INSTALL_HINT = "rollout workers need Ray: pip install 'flashrl[ray]'"


class RolloutWorkerError(FlashRLError, RuntimeError):
    """A rollout worker died, failed, or did not answer within the timeout (named in the
    message)."""


def death_cause(err: BaseException) -> str:
    """Why a Ray actor died, in one line: the exception its constructor raised when Ray's message
    carries one (the last ``module.Error: message`` line, e.g. vLLM missing on that worker's
    machine), else the error type."""
    if getattr(err, "actor_init_failed", False):
        for line in reversed(str(err).splitlines()):
            found = re.match(r"^\s*([\w.]*(?:Error|Exception)): (.+)$", line)
            if found:
                return (
                    f"its backend failed to start: {found.group(1).rsplit('.', 1)[-1]}: "
                    + found.group(2)
                )
    return type(err).__name__


def require_ray() -> Any:
    """The `ray` module, or an `UnsupportedError` with the install hint."""
    try:
        import ray
    except ImportError:
        raise UnsupportedError(INSTALL_HINT) from None
    return ray


class WorkerPool:
    """N `RolloutWorker` actors, a process group with the trainer as rank 0, and the calls the
    trainer makes on them: `submit` / `collect` (generate shards), `update_weights`, `stats`,
    `shutdown`.
    `config` is the run's ``rollout.workers`` itself; `device` is where the weight group's buckets
    live (cpu: gloo; cuda: NCCL)."""

    def __init__(
        self, factory: Callable[[], RolloutBackend], config: WorkersConfig, device: str = "cpu"
    ) -> None:
        if config.count < 1:
            raise ConfigError(f"WorkerPool needs rollout.workers.count >= 1, got {config.count}")
        self.ray = ray = require_ray()
        self.config, self.device, self.owns_ray = config, device, False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if config.address is None:
                kwargs["num_cpus"] = max(math.ceil(config.count * config.cpus), 1)
            connect(ray, config.address, config.timeout, **kwargs)
            self.owns_ray = True
        try:  # an actor the cluster cannot place would wait forever
            check_resources(ray, config.count, config.cpus, config.gpus, config.address)
        except BaseException:
            self.shutdown()
            raise
        actor = ray.remote(RolloutWorker).options(
            num_cpus=config.cpus, num_gpus=config.gpus, max_restarts=0, max_concurrency=1
        )
        self.workers = [actor.remote(factory, i, config.threads) for i in range(config.count)]
        self.group, self.delta = None, None
        try:
            infos = self.wait([w.ready.remote() for w in self.workers], "start")
            self.quantized: dict[str, str] = infos[0]["quantized"]
            self.dense: dict[str, str] = infos[0]["dense"]
            self._join_group()
        except BaseException:
            self.shutdown()
            raise

    def _join_group(self) -> None:
        c, device = self.config, self.device
        host = "127.0.0.1" if c.address is None else self.ray.util.get_node_ip_address()
        port, world = free_port(host), c.count + 1
        futures = [
            w.join_group.remote(host, port, world, device, c.timeout, c.bucket_bytes)
            for w in self.workers
        ]
        self.group = make_group(host, port, 0, world, device, c.timeout)
        self.wait(futures, "join the weight group")
        self.broadcast = BucketBroadcast(self.group, device, c.bucket_bytes)

    # ------------------------------------------------------------------ remote calls

    def wait(self, futures: Sequence[Any], what: str) -> list[Any]:
        """The results of one call per worker (future i belongs to worker i), or a
        `RolloutWorkerError` naming the first worker that failed or missed the deadline."""
        ray = self.ray
        done, pending = ray.wait(
            list(futures), num_returns=len(futures), timeout=self.config.timeout
        )
        out = []
        for i, f in enumerate(futures):
            if f not in done:
                names = [f"rollout worker {futures.index(p)}" for p in pending]
                raise RolloutWorkerError(
                    f"{', '.join(names)} did not {what} within {self.config.timeout:g} s "
                    f"(rollout.workers.timeout); the run stops here"
                )
            try:
                out.append(ray.get(f))
            except ray.exceptions.RayActorError as err:
                raise RolloutWorkerError(
                    f"rollout worker {i} died during '{what}' ({death_cause(err)}); the run "
                    f"stops here"
                ) from err
            except ray.exceptions.RayTaskError as err:
                raise RolloutWorkerError(
                    f"rollout worker {i} failed during '{what}': {err.cause!r}"
                ) from err
        return out

    def submit(
        self, shards: Sequence[tuple[list[list[int]], SamplingParams]], owners: list[list[int]]
    ) -> list[Any]:
        """Start generating: worker w runs the shards `owners[w]`; returns the futures."""
        return [
            w.generate.remote([shards[s] for s in mine])
            for w, mine in zip(self.workers, owners, strict=True)
        ]

    def collect(self, futures: list[Any], owners: list[list[int]]) -> list[list[Rollout]]:
        """The rollouts of every shard, in shard order."""
        results = self.wait(futures, "generate")
        parts: dict[int, list[Rollout]] = {}
        for mine, got in zip(owners, results, strict=True):
            parts.update(zip(mine, got, strict=True))
        return [parts[s] for s in sorted(parts)]

    def update_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Broadcast new weights to every worker (phases: plan, send, finish); returns
        ``sent_bytes``, the trainer's ``plan_s`` and ``send_s``, each worker's
        ``worker<i>/weight_update_s``, ``requantize_s`` and ``kv_calibration_s`` (and their max
        over workers) and, with the ``delta`` payload, ``delta_*``: the fraction of codes changed
        and of scales kept, whether the update was full, how many tensors a checksum mismatch
        resent."""
        if self.config.payload == "delta":
            return self._update_delta(named)
        if self.delta is not None:  # the workers' codes change behind the mirror's back
            self.delta.needs_full = True
        start = time.perf_counter()
        named = [(n, t.detach()) for n, t in named]
        metas = plan(named, self.config.payload, self.quantized)
        plan_s = time.perf_counter() - start
        sent, results = self._send(metas, payload_tensors(named, metas, self.quantized))
        out = {"sent_bytes": sent["sent_bytes"], "send_s": sent["send_s"], "plan_s": plan_s}
        return self._worker_stats(out, results)

    def _update_delta(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
        c = self.config
        if self.delta is None or (self.delta.band, self.delta.full_every) != (
            c.delta_scale_band,
            c.delta_full_every,
        ):
            self.delta = DeltaSender(c.delta_scale_band, c.delta_full_every)
        out, results = delta_update(
            self.delta,
            named,
            self.quantized,
            lambda m, t: self._send(m, t, checksums=True),
            self.dense,
        )
        return self._worker_stats(out, results)

    def _send(
        self, metas: list, tensors: Iterable[torch.Tensor], checksums: bool = False
    ) -> tuple[dict[str, float], list[dict]]:
        futures = [w.receive.remote(metas, checksums) for w in self.workers]
        try:
            sent = self.broadcast.send(tensors)
        except RuntimeError as err:
            self.wait(futures, "receive weights")  # names the worker that broke the group
            raise RolloutWorkerError(f"weight broadcast failed: {err}") from err
        return sent, self.wait(futures, "receive weights")

    @staticmethod
    def _worker_stats(out: dict[str, float], results: list[dict]) -> dict[str, float]:
        for i, r in enumerate(results):
            out.update({f"worker{i}/{k}": v for k, v in r.items() if k != "checksums"})
        out["requantize_s"] = max(r["requantize_s"] for r in results)
        out["kv_calibration_s"] = max(r["kv_calibration_s"] for r in results)
        return out

    def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every worker (stats, state, update_weights, ping)."""
        return self.wait([getattr(w, method).remote(*args) for w in self.workers], method)

    def shutdown(self) -> None:
        """Stop the workers (and the local Ray instance this pool started)."""
        for w in getattr(self, "workers", []):
            try:
                self.ray.kill(w)
            except Exception as err:  # a dead worker is already gone
                logger.debug("kill: %s", err)
        self.workers = []
        if self.owns_ray:
            self.ray.shutdown()
            self.owns_ray = False
