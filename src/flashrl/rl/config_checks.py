"""Range checks of `TrainConfig`'s numbers and paths, called by `TrainConfig.validate`.

Every float of the data, algo and run groups must be finite (``inf`` and ``nan`` parse as floats
but would fail much later, naming a tensor); the rollout (and its workers) and correction groups
check their own numbers. Then each number that has a sign or a bound gets it, with a
`ConfigError` naming the dotted field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from flashrl.errors import ConfigError

MAX_LR = 1.0
"""The largest `algo.lr`: AdamW moves every weight by about lr per step, so a larger one destroys
the policy in one step (1e38 overflowed the weights to inf)."""


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
    if not isinstance(r.output_dir, str) or not r.output_dir.strip():
        raise ConfigError(
            f"run.output_dir={r.output_dir!r} is empty; allowed: a directory path (created if "
            f"missing), e.g. runs/flashrl; '.' for the current directory"
        )


def check_workers(config: Any) -> None:
    """What needs the built-in engine in the trainer's process (the rollout group checks its own
    fields, `flashrl.rl.config_rollout`)."""
    r = config.rollout
    where = "(rollout.backend=builtin, rollout.workers.count=0)"
    got = f"got rollout.backend={r.backend}, rollout.workers.count={r.workers.count}"
    if r.backend == "builtin" and r.workers.count == 0:
        return
    if config.run.log_weight_changes:
        raise ConfigError(
            f"run.log_weight_changes needs the built-in engine in the trainer's process {where}; "
            f"{got}"
        )
    if config.algo.routing_replay:
        raise ConfigError(
            f"algo.routing_replay needs the built-in engine in the trainer's process {where}; {got}"
        )


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
}
"""What each bounded float allows (after "allowed:"), shared by the finiteness and range errors."""


def _integer_at_least_0(name: str, value: Any, zero: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} is invalid; allowed: an integer >= 0 ({zero})")
