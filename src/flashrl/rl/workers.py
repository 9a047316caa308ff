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
    process and in every rollout worker), built by the factory `run.backend` names
    (`flashrl.rl.backends`)."""
    a, r = config.algo, config.run
    max_len = a.max_prompt_tokens + a.max_response_tokens
    request = BackendRequest(config, model_dir, device, max_len, min(r.max_batch, a.batch_size))
    return build_backend(request)


def num_shards(config: TrainConfig) -> int:
    """generate calls per step: `run.rollout_shards`, else one per worker (one in-process)."""
    r = config.run
    return r.rollout_shards or max(r.rollout_workers, 1)


def make_rollouts(
    config: TrainConfig,
    model_dir: Path,
    device: torch.device,
    backend: RolloutBackend | None,
) -> tuple[RolloutBackend | None, LocalRollouts | PoolRollouts]:
    """The in-process backend (None with rollout workers) and the rollout source of a run."""
    r = config.run
    if r.rollout_workers == 0:
        backend = backend or make_backend(config, model_dir, device)
        return backend, LocalRollouts(backend, num_shards(config), r.log_weight_changes)
    if backend is not None:
        raise ConfigError(
            "Trainer(backend=...) runs in-process; leave run.rollout_workers at 0 to use it"
        )
    from flashrl.distributed.pool import PoolConfig, WorkerPool

    pool_device = "cuda" if r.worker_gpus > 0 and device.type == "cuda" else "cpu"
    worker_device = torch.device("cuda") if r.worker_gpus > 0 else torch.device("cpu")
    pool = WorkerPool(
        functools.partial(make_backend, config, model_dir, worker_device),
        PoolConfig(
            workers=r.rollout_workers,
            address=r.ray_address,
            cpus=r.worker_cpus,
            gpus=r.worker_gpus,
            threads=r.worker_threads,
            device=pool_device,
            payload=r.weight_payload,
            delta_band=r.delta_scale_band,
            delta_full_every=r.delta_full_every,
            bucket_bytes=r.bucket_mb * 2**20,
            timeout_s=r.worker_timeout,
        ),
    )
    return None, PoolRollouts(pool, num_shards(config))
