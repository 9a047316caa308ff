"""What the fields of a `TrainConfig` need of each other, called by `TrainConfig.validate` after
each field's own rule (`flashrl.core.fields`). Errors name every dotted field involved."""

from __future__ import annotations

from typing import Any

from flashrl.errors import ConfigError


def check_algo(a: Any) -> None:
    """The overlong penalty starts inside the response; GSPO aggregates per sequence (as verl
    forces) and has no dual clip."""
    if 0 < a.max_response_tokens <= a.overlong_buffer:
        raise ConfigError(
            f"algo.overlong_buffer={a.overlong_buffer} must be smaller than "
            f"algo.max_response_tokens={a.max_response_tokens} (the penalty starts "
            f"overlong_buffer tokens before the limit)"
        )
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
