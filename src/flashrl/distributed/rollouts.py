"""The trainer's rollout source: in-process or on a `WorkerPool`, synchronous or one step ahead.

Both split a step's prompts into the same shards (`sharding`), so for a given ``num_shards`` the
rollouts are the same bits in-process, on 1 worker or on N. `submit` starts a step's generation
and `collect` returns its rollouts; the in-process source generates in `collect`, the pool in
the background, which is what async rollouts use: the trainer submits step t+1 before it trains
step t, and the weight update after step t queues behind that generation on every worker (a Ray
actor runs one call at a time), so step t+1's rollouts come from the weights before step t's
update: one step stale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from flashrl.core.rollout import Rollout, RolloutBackend
from flashrl.core.sampling import SamplingParams
from flashrl.distributed.pool import WorkerPool
from flashrl.distributed.sharding import assign, merge, shard_bounds, shard_seed


def shard_calls(
    encoded: list[list[int]], params: SamplingParams, num_shards: int
) -> tuple[list[tuple[int, int]], list[tuple[list[list[int]], SamplingParams]]]:
    """The prompt ranges of a step and one ``(prompts, params)`` generate call per range."""
    assert params.seed is not None, "a step's sampling params carry its seed"
    bounds = shard_bounds(len(encoded), num_shards)
    calls = [
        (encoded[a:b], dataclasses.replace(params, seed=shard_seed(params.seed, a)))
        for a, b in bounds
    ]
    return bounds, calls


class LocalRollouts:
    """Generation and weight updates in the trainer's process (today's path: no copy)."""

    def __init__(
        self, backend: RolloutBackend, num_shards: int = 1, count_changed: bool = False
    ) -> None:
        self.backend, self.num_shards = backend, num_shards
        self.count_changed = count_changed
        """Ask the backend (the built-in engine) what fraction of the stored rollout weights each
        update changed (``*_changed_frac`` keys of `update_weights`)."""

    def submit(self, encoded: list[list[int]], params: SamplingParams) -> Any:
        return shard_calls(encoded, params, self.num_shards)

    def collect(self, handle: Any) -> list[Rollout]:
        bounds, calls = handle
        return merge(bounds, [self.backend.generate(p, s) for p, s in calls])

    def update_weights(self, named: Any) -> dict[str, float]:
        """The backend's `update_weights`: ``transfer_s``, ``requantize_s``, ``kv_calibration_s``
        and, with `count_changed`, the ``*_changed_frac`` fractions."""
        if self.count_changed:
            out = self.backend.update_weights(named, count_changed=True)
        else:
            out = self.backend.update_weights(named)
        return {
            "transfer_s": out.get("transfer_s", 0.0),
            "requantize_s": out.get("requantize_s", 0.0),
            "kv_calibration_s": out.get("kv_calibration_s", 0.0),
            **{k: v for k, v in out.items() if k.endswith("_changed_frac")},
        }

    def close(self) -> None:
        """Nothing to release in-process."""


class PoolRollouts:
    """Generation and weight updates on a `WorkerPool` (sharded round robin over its workers)."""

    def __init__(self, pool: WorkerPool, num_shards: int) -> None:
        self.pool, self.num_shards = pool, num_shards

    def submit(self, encoded: list[list[int]], params: SamplingParams) -> Any:
        bounds, calls = shard_calls(encoded, params, self.num_shards)
        owners = assign(len(calls), len(self.pool.workers))
        return bounds, owners, self.pool.submit(calls, owners)

    def collect(self, handle: Any) -> list[Rollout]:
        bounds, owners, futures = handle
        return merge(bounds, self.pool.collect(futures, owners))

    def update_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """The pool's `update_weights`, keyed as `LocalRollouts.update_weights` (``transfer_s`` is
        the trainer's broadcast, ``send_s``), plus ``worker<i>/weight_update_s``, ``sent_bytes``
        and ``delta_*``."""
        out = self.pool.update_weights(named)
        metrics = {
            "transfer_s": out["send_s"],
            "requantize_s": out["requantize_s"],
            "kv_calibration_s": out["kv_calibration_s"],
        }
        for key, value in out.items():
            if key.startswith("worker") and key.endswith("/weight_update_s"):
                metrics[key] = value
        metrics["sent_bytes"] = out["sent_bytes"]
        metrics.update({k: v for k, v in out.items() if k.startswith("delta_")})
        return metrics

    def close(self) -> None:
        self.pool.shutdown()
