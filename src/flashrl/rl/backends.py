"""The rollout backends a run can select by name (`rollout.backend`): one registry, one factory signature.

A factory takes a `BackendRequest` (the run's config, the weights to load, the device and the sizes
the trainer derived) and returns a `flashrl.core.rollout.RolloutBackend`: ``generate``,
``update_weights``, ``stats``. The same factory runs in the trainer's process and in every rollout
worker. Registered here: ``builtin`` (`flashrl.engine.Engine`) and ``vllm``
(`flashrl.vllm_backend.VLLMBackend`); another engine registers with `register_backend` and nothing
in `flashrl.rl` changes (tests/test_backends.py registers a toy one). docs/architecture.md says what
an SGLang backend would implement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashrl.core.device import resolve_dtype
from flashrl.core.rollout import RolloutBackend
from flashrl.errors import ConfigError

__all__ = ["BackendRequest", "backend_names", "build_backend", "register_backend"]


@dataclass(frozen=True)
class BackendRequest:
    """What a backend factory is given."""

    config: Any
    """The run's `TrainConfig` (`rollout` group: quantization, dtype, backend kwargs; `run`: the
    seed). A backend's engine reads `config.rollout.as_rollout_config()`."""
    model_dir: Path
    device: torch.device
    max_len: int
    """Prompt + response tokens per sequence."""
    max_batch: int
    """Sequences generated at once."""


BackendFactory = Callable[[BackendRequest], RolloutBackend]


def _builtin(request: BackendRequest) -> RolloutBackend:
    from flashrl.engine.engine import Engine, EngineConfig

    r = request.config.rollout
    engine = EngineConfig(
        dtype=r.dtype,
        device=request.device,
        max_batch=request.max_batch,
        max_len=request.max_len,
        progress=False,
        cpu_mirror_memory=worker_mirror_memory(r.workers.count),
    )
    return Engine(request.model_dir, r.as_rollout_config(), engine)


def worker_mirror_memory(workers: int) -> int | None:
    """The CPU weight-copy budget of one rollout engine: the engine's default in the trainer's
    process, that default shared out among `workers` Ray workers, which may all run on one
    machine."""
    from flashrl.quant.cpu_mirror import default_budget_bytes

    return default_budget_bytes(workers) if workers else None


def _vllm(request: BackendRequest) -> RolloutBackend:
    from flashrl.vllm_backend.install_check import require_vllm

    require_vllm("rollout.backend=vllm")  # one line with the install commands, not ImportError
    from flashrl.vllm_backend import VLLMBackend

    r = request.config.rollout
    kwargs = {"max_model_len": request.max_len, "max_num_seqs": request.max_batch}
    kwargs.update(r.backend_kwargs_dict())
    return VLLMBackend(
        request.model_dir,
        r.as_rollout_config(),
        dtype=resolve_dtype(r.dtype),
        seed=request.config.run.seed,
        **kwargs,
    )


_REGISTRY: dict[str, BackendFactory] = {"builtin": _builtin, "vllm": _vllm}
"""Registered factories by name: the registry itself (written only by `register_backend`)."""


def register_backend(name: str, factory: BackendFactory, replace: bool = False) -> None:
    """Make `rollout.backend=name` build its rollouts with `factory`; an existing name needs
    `replace=True` (a ConfigError otherwise, so two plugins never shadow each other silently)."""
    if not isinstance(name, str) or not name.strip() or not callable(factory):
        raise ConfigError(f"register_backend needs a non-empty name and a callable, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ConfigError(f"rollout backend {name!r} is already registered; pass replace=True")
    _REGISTRY[name] = factory


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def build_backend(request: BackendRequest) -> RolloutBackend:
    """The backend `request.config.rollout.backend` names, built by its factory."""
    name = request.config.rollout.backend
    if name not in _REGISTRY:
        raise ConfigError(f"rollout.backend={name!r} is invalid; allowed: {', '.join(_REGISTRY)}")
    return _REGISTRY[name](request)
