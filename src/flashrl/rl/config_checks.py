"""What the fields of a `TrainConfig` need of each other, called by `TrainConfig.validate` after
each field's own rule (`flashrl.core.fields`). Errors name every dotted field involved."""

from __future__ import annotations

from typing import Any

from flashrl.errors import ConfigError


def check_relations(config: Any) -> None:
    """Raise a ConfigError naming the fields of the first need that is not met."""
    _check_batch(config.algo)
    _check_algo(config.algo)
    if config.correction.mode == "bypass" and config.algo.mini_batches > 1:
        raise ConfigError(
            "correction.mode='bypass' takes the PPO ratio against the rollout "
            "policy; use algo.mini_batches=1"
        )
    _check_workers(config)


def _check_batch(a: Any) -> None:
    """A batch is whole groups, and so is each mini-batch."""
    if a.batch_size % a.group_size:
        raise ConfigError(
            f"algo.batch_size={a.batch_size} is not divisible by "
            f"algo.group_size={a.group_size}; batch_size counts sequences "
            f"(prompts per step x group_size)"
        )
    mini = a.batch_size // a.mini_batches
    if mini * a.mini_batches != a.batch_size or mini % a.group_size:
        raise ConfigError(
            f"algo.batch_size={a.batch_size} must split into "
            f"algo.mini_batches={a.mini_batches} whole groups of {a.group_size}"
        )
    if a.group_size < 2 and a.advantage != "drgrpo":
        raise ConfigError(f"algo.advantage={a.advantage!r} needs algo.group_size >= 2")


def _check_algo(a: Any) -> None:
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


def _check_workers(config: Any) -> None:
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


def rounding_lag_warning(config: Any) -> str | None:
    """A warning when the run is exposed to the bf16 lag: unquantized 16-bit rollout weights, an
    fp32 trainer and nearest rounding at each weight update. Adam steps below half a bf16 step
    round back to the old value, so the rollout policy stays near the checkpoint while the trainer
    moves (SmolLM2-135M, 40 steps, 3 seeds: reward 0.15 against fp32 rollouts' 0.67, and 0.69 with
    stochastic rounding; docs/real-model.md). None when the run is not exposed."""
    r = config.rollout
    exposed = r.quant == "bf16" and r.dtype in ("bf16", "fp16") and r.sync_rounding == "nearest"
    if not exposed or config.run.trainer_dtype != "fp32":
        return None
    fix = (
        "--rollout.sync-rounding stochastic (built-in engine) or " if r.backend == "builtin" else ""
    )
    return (
        f"rollout.quant=bf16 with rollout.dtype={r.dtype} and an fp32 trainer: each weight update "
        f"rounds the trainer's weights to {r.dtype} to nearest, which erases updates below half a "
        f"{r.dtype} step, so the rollout policy can lag the trainer (SmolLM2-135M, 40 steps: "
        f"reward 0.15 against 0.69 with stochastic rounding; docs/real-model.md); "
        f"{fix}--rollout.dtype fp32 keeps it following"
    )
