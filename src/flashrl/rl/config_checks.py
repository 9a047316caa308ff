"""Range checks of `TrainConfig`'s numbers and paths, called by `TrainConfig.validate`.

Every float of the data, algo and run groups must be finite (``inf`` and ``nan`` parse as floats
but would fail much later, naming a tensor or overflowing a timeout); the rollout and correction
groups check their own numbers. Then each number that has a sign or a bound gets it, with a
`ConfigError` naming the dotted field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from flashrl.core.config import RolloutConfig
from flashrl.errors import ConfigError

PAYLOADS = ("stream", "codes", "delta")
"""`run.weight_payload` values (`flashrl.distributed.transport.PAYLOADS`, not imported here: the
config must not need the distributed package)."""

MAX_LR = 1.0
"""The largest `algo.lr`: AdamW moves every weight by about lr per step, so a larger one destroys
the policy in one step (1e38 overflowed the weights to inf)."""
MAX_WORKER_TIMEOUT_S = 1e7
"""The longest `run.worker_timeout` (about 115 days): larger values overflow the timeouts of
`datetime.timedelta`, sockets and Ray."""


def check_numbers(config: Any) -> None:
    """Raise a ConfigError naming the first non-finite float or out-of-range number."""
    for group in ("data", "algo", "run"):
        values = getattr(config, group)
        for f in fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                name = f"{group}.{f.name}"
                allowed = _RANGES.get(name, " a finite number")
                raise ConfigError(f"{name}={value!r} is not a finite number; allowed:{allowed}")
    a, r = config.algo, config.run
    if not 0 < a.lr <= MAX_LR:
        raise ConfigError(f"algo.lr={a.lr!r} is out of range; allowed:{_RANGES['algo.lr']}")
    for name in ("weight_decay", "grad_clip", "kl_coef", "overlong_penalty"):
        value = getattr(a, name)
        if value < 0:
            allowed = _RANGES[f"algo.{name}"]
            raise ConfigError(f"algo.{name}={value!r} is negative; allowed:{allowed}")
    _integer_at_least_0("algo.warmup_steps", a.warmup_steps, "0: no warmup")
    _integer_at_least_0("algo.overlong_buffer", a.overlong_buffer, "0: no overlong penalty")
    if 0 < a.max_response_tokens <= a.overlong_buffer:
        raise ConfigError(
            f"algo.overlong_buffer={a.overlong_buffer} must be smaller than "
            f"algo.max_response_tokens={a.max_response_tokens} (the penalty starts "
            f"overlong_buffer tokens before the limit)"
        )
    _integer_at_least_0("run.save_every", r.save_every, "0: save only at the end")
    for name in ("worker_cpus", "worker_gpus"):
        value = getattr(r, name)
        if value < 0:
            allowed = _RANGES[f"run.{name}"]
            raise ConfigError(f"run.{name}={value!r} is negative; allowed:{allowed}")
    if not 0 < r.worker_timeout <= MAX_WORKER_TIMEOUT_S:
        raise ConfigError(
            f"run.worker_timeout={r.worker_timeout!r} is out of range; "
            f"allowed:{_RANGES['run.worker_timeout']}"
        )
    if not isinstance(r.output_dir, str) or not r.output_dir.strip():
        raise ConfigError(
            f"run.output_dir={r.output_dir!r} is empty; allowed: a directory path (created if "
            f"missing), e.g. runs/flashrl; '.' for the current directory"
        )


def check_workers(config: Any) -> None:
    """The rollout-worker fields: counts, the weight payload and its delta settings, and what
    needs the built-in engine in the trainer's process."""
    r = config.run
    for name in ("rollout_workers", "rollout_shards"):
        value = getattr(r, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"run.{name}={value!r} must be an integer >= 0")
    if r.weight_payload not in PAYLOADS:
        raise ConfigError(
            f"run.weight_payload={r.weight_payload!r}; allowed: {', '.join(PAYLOADS)}"
        )
    band = r.delta_scale_band
    if isinstance(band, bool) or not isinstance(band, int | float) or not 0 <= band < 1:
        allowed = _RANGES["run.delta_scale_band"]
        raise ConfigError(f"run.delta_scale_band={band!r} is invalid; allowed:{allowed}")
    _integer_at_least_0(
        "run.delta_full_every", r.delta_full_every, "0: only the first sync and repairs"
    )
    check_payload(r.weight_payload, config.rollout, r.rollout_workers)
    if r.bucket_mb < 1 or r.worker_timeout <= 0 or r.worker_threads < 1 or r.worker_tp < 1:
        raise ConfigError(
            "run.bucket_mb, run.worker_threads and run.worker_tp must be >= 1 and "
            "run.worker_timeout > 0"
        )
    if r.log_weight_changes and (r.rollout_workers or r.backend != "builtin"):
        raise ConfigError(
            "run.log_weight_changes needs the built-in engine in the trainer's process "
            "(run.backend=builtin, run.rollout_workers=0)"
        )
    if config.algo.routing_replay and (r.rollout_workers or r.backend != "builtin"):
        raise ConfigError(
            f"algo.routing_replay needs the built-in engine in the trainer's process "
            f"(run.backend=builtin, run.rollout_workers=0); got run.backend={r.backend}, "
            f"run.rollout_workers={r.rollout_workers}"
        )
    if r.async_rollouts and r.rollout_workers < 1:
        raise ConfigError("run.async_rollouts needs run.rollout_workers >= 1")
    if r.worker_tp > 1 and r.backend != "vllm":
        raise ConfigError("run.worker_tp > 1 needs run.backend=vllm")


def check_policy_loss(a: Any) -> None:
    """What a policy loss needs from the other algo fields: GSPO aggregates per sequence (as verl
    forces) and has no dual clip."""
    if a.policy_loss != "gspo":
        return
    if a.loss_aggregation != "seq_mean_token_mean":
        raise ConfigError(
            f"algo.policy_loss=gspo averages per sequence: set algo.loss_aggregation "
            f"seq_mean_token_mean (got {a.loss_aggregation}); GSPO's clip range is also "
            f"much narrower than PPO's (paper: algo.clip_low 0.0003, algo.clip_high 0.0004)"
        )
    if a.dual_clip is not None:
        raise ConfigError(f"algo.dual_clip={a.dual_clip!r} does not apply to gspo; leave it unset")


_RANGES = {
    "algo.lr": f" a number > 0 and <= {MAX_LR:g} (AdamW moves each weight by about lr per step)",
    "algo.weight_decay": " a number >= 0 (0: no weight decay)",
    "algo.grad_clip": " a number >= 0 (0: no clipping)",
    "algo.kl_coef": " a number >= 0 (0: no KL penalty)",
    "algo.overlong_penalty": " a number >= 0 (a negative one would reward overlong answers)",
    "run.worker_cpus": " a number >= 0 (Ray CPUs per rollout worker)",
    "run.worker_gpus": " a number >= 0 (Ray GPUs per rollout worker)",
    "run.worker_timeout": f" seconds > 0 and <= {MAX_WORKER_TIMEOUT_S:g}",
    "run.delta_scale_band": " a number >= 0 and < 1 (0: fresh scales at every sync)",
}
"""What each bounded float allows (after "allowed:"), shared by the finiteness and range errors."""


def _integer_at_least_0(name: str, value: Any, zero: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} is invalid; allowed: an integer >= 0 ({zero})")


def check_payload(weight_payload: str, rollout: RolloutConfig, workers: int = 0) -> None:
    """Refuse a payload of trainer-made codes with rollout settings only the workers' own
    quantization honours (smoothing, stochastic sync rounding), and smoothing on Ray workers,
    whose per-tensor stream never refreshes the factors."""
    if workers and rollout.smooth is not None:
        raise ConfigError(
            f"rollout.smooth={rollout.smooth} runs in the trainer's own engine only "
            f"(run.rollout_workers=0); got run.rollout_workers={workers}"
        )
    if weight_payload != "stream" and (
        rollout.smooth is not None or rollout.sync_rounding != "nearest"
    ):
        raise ConfigError(
            f"run.weight_payload={weight_payload} sends codes the trainer rounds to nearest "
            "without smoothing; rollout.smooth and rollout.sync_rounding=stochastic need "
            "run.weight_payload=stream (the workers quantize)"
        )
