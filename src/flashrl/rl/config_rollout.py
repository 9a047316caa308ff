"""`TrainRolloutConfig`: the ``rollout`` group of `flashrl train`, every rollout setting in one home.

It is the core `RolloutConfig` (what the rollout policy is: scheme, skip list, KV cache, logprobs,
sync rounding, smoothing) plus what only a training run decides: the engine that runs it
(``backend``, its ``backend_kwargs``, ``dtype``, ``max_batch``), how a step's requests are cut
(``shards``) and the Ray workers (``workers``, the `WorkersConfig` the worker pool itself runs
with). The engines and the vLLM plugin read only the core part (`as_rollout_config`): a
``FLASHRL_CONFIG`` or ``rollout.file`` YAML with a train-only key is refused as an unknown key,
and passing a `TrainRolloutConfig` where a `RolloutConfig` is expected is refused, naming the fields
it would ignore (`flashrl.core.config.resolve_config`). docs/architecture.md says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from flashrl.core.config import RolloutConfig
from flashrl.core.fields import check_fields, choice, integer, setting
from flashrl.distributed.config import WorkersConfig
from flashrl.errors import ConfigError
from flashrl.model.remote_code import check_trust_remote_code
from flashrl.rl.backends import backend_names

ROLLOUT_DTYPES = ("bf16", "fp16", "fp32")
CORE_FIELDS = tuple(f.name for f in fields(RolloutConfig))
"""The fields `TrainRolloutConfig` shares with the core `RolloutConfig`."""


@dataclass(frozen=True)
class TrainRolloutConfig(RolloutConfig):
    """Every rollout setting of a training run: the core `RolloutConfig` fields, then these."""

    quant: str = "int8"  # the core field, with the training default
    dtype: str = choice("bf16", ROLLOUT_DTYPES)
    """Activation dtype of the rollout engine: bf16, fp16 or fp32."""
    backend: str = choice("builtin", backend_names)
    """The rollout engine, a name of `flashrl.rl.backends` (builtin, vllm, or one registered)."""
    backend_kwargs: str | None = setting(None, resume_free=True)
    """JSON object of extra backend arguments: for 'vllm' the `vllm.LLM(...)` keywords, e.g.
    '{"enforce_eager": true}' or '{"tensor_parallel_size": 2}'; 'builtin' takes none."""
    max_batch: int = integer(256, resume_free=True)
    """Sequences the engine decodes at once (the built-in engine's KV-cache slots)."""
    shards: int = integer(0, least=0, note="0: one per worker")
    """generate calls per step (prompts split evenly); rollouts depend on it, not on the number of
    workers. 0: max(workers.count, 1)."""
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    """Rollout workers on Ray (docs/distributed.md): the worker pool's own config."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ConfigError as err:
            raise ConfigError(f"rollout: {err}") from None
        check_fields(self, "rollout.", skip=CORE_FIELDS)
        if not isinstance(self.workers, WorkersConfig):
            raise ConfigError(f"rollout.workers must be a WorkersConfig, got {self.workers!r}")
        if self.backend_kwargs_dict() and self.backend == "builtin":
            raise ConfigError(
                "rollout.backend_kwargs are arguments of another backend (vllm.LLM's for "
                "rollout.backend=vllm); the builtin engine takes none: leave it unset"
            )
        self._check_payload()

    def _check_payload(self) -> None:
        """Refuse a payload of trainer-made codes with settings only the workers' own quantization
        honours (smoothing, stochastic sync rounding), and smoothing on Ray workers, whose
        per-tensor stream never refreshes the factors."""
        w = self.workers
        if w.count and self.smooth is not None:
            raise ConfigError(
                f"rollout.smooth={self.smooth} runs in the trainer's own engine only "
                f"(rollout.workers.count=0); got rollout.workers.count={w.count}"
            )
        if w.payload != "stream" and (self.smooth is not None or self.sync_rounding != "nearest"):
            raise ConfigError(
                f"rollout.workers.payload={w.payload} sends codes the trainer rounds to nearest "
                "without smoothing; rollout.smooth and rollout.sync_rounding=stochastic need "
                "rollout.workers.payload=stream (the workers quantize)"
            )

    def backend_kwargs_dict(self) -> dict[str, Any]:
        """`backend_kwargs` parsed (a JSON object; ``trust_remote_code`` refused)."""
        if not self.backend_kwargs:
            return {}
        text = self.backend_kwargs
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"rollout.backend_kwargs={text!r} is not valid JSON ({err.msg})"
            ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"rollout.backend_kwargs={text!r} must be a JSON object")
        check_trust_remote_code(value, "rollout.backend_kwargs")
        return value

    def as_rollout_config(self) -> RolloutConfig:
        """The core part, what a rollout engine reads (the engine fields travel apart)."""
        return RolloutConfig(**{name: getattr(self, name) for name in CORE_FIELDS})
