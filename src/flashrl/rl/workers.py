"""Where a run's rollouts are generated: the backend the trainer builds (in its process or in each
rollout worker) and the rollout source it drives (`flashrl.distributed.rollouts`)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from flashrl.core.rollout import RolloutBackend
from flashrl.distributed.rollouts import LocalRollouts, PoolRollouts
from flashrl.errors import ConfigError
from flashrl.rl.backends import BackendRequest, build_backend
from flashrl.rl.config import TrainConfig


def make_backend(config: TrainConfig, model_dir: Path, device: torch.device) -> RolloutBackend:
    """The rollout backend of `config` on the weights in `model_dir` (the same in the trainer's
    process and in every rollout worker), built by the factory `rollout.backend` names
    (`flashrl.rl.backends`)."""
    a, r = config.algo, config.rollout
    max_len = a.max_prompt_tokens + a.max_response_tokens
    request = BackendRequest(config, model_dir, device, max_len, min(r.max_batch, a.batch_size))
    return build_backend(request)


def num_shards(config: TrainConfig) -> int:
    """generate calls per step: `rollout.shards`, else one per worker (one in-process)."""
    r = config.rollout
    return r.shards or max(r.workers.count, 1)


def make_rollouts(
    config: TrainConfig,
    model_dir: Path,
    device: torch.device,
    backend: RolloutBackend | None,
) -> tuple[RolloutBackend | None, LocalRollouts | PoolRollouts]:
    """The in-process backend (None with rollout workers) and the rollout source of a run."""
    w = config.rollout.workers
    if w.count == 0:
        backend = backend or make_backend(config, model_dir, device)
        return backend, LocalRollouts(backend, num_shards(config), config.run.log_weight_changes)
    if backend is not None:
        raise ConfigError(
            "Trainer(backend=...) runs in-process; leave rollout.workers.count at 0 to use it"
        )
    from flashrl.distributed.pool import WorkerPool

    pool_device = "cuda" if w.gpus > 0 and device.type == "cuda" else "cpu"
    worker_device = torch.device("cuda") if w.gpus > 0 else torch.device("cpu")
    factory = functools.partial(make_backend, config, model_dir, worker_device)
    pool = WorkerPool(factory, w, device=pool_device)  # the config's own workers group
    return None, PoolRollouts(pool, num_shards(config))
