"""The record phase: one step's metrics (a line of metrics.jsonl, written by the trainer's loop)
and its lines of samples.jsonl (`flashrl.rl.samples`).

Metric keys, in the order they are written: ``step``, ``rollout/staleness`` (async rollouts),
``reward/*``, ``response/*``, ``batch/kept_frac``; then the update's ``rollout_corr/*`` and
``actor/*`` and the weight update's ``weight_update/*``, or ``skipped_update`` when no group was informative; then
``time/*_s`` (seconds per phase), ``throughput/rollout_tokens_per_s`` and ``memory/peak_gib``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashrl.core.device import peak_memory_bytes
from flashrl.core.rollout import Rollout
from flashrl.rl.config import TrainConfig
from flashrl.rl.phases.generate import Generated
from flashrl.rl.phases.score import Scored
from flashrl.rl.phases.update import Updated
from flashrl.rl.phases.weight_update import WeightUpdate
from flashrl.rl.samples import collect, record_samples


@dataclass
class StepResult:
    """What one step's phases returned."""

    step: int
    generated: Generated
    scored: Scored
    updated: Updated | None
    """None when the update was skipped (no informative group); then `weight_update` is None too."""
    weight_update: WeightUpdate | None
    seconds: float
    """The whole step until the record phase."""


def record(
    result: StepResult, config: TrainConfig, device: torch.device, tokenizer: Any, samples: Path
) -> dict[str, float]:
    """The step's metrics; its samples appended to samples.jsonl at `samples`."""
    metrics = step_metrics(result, config, device)
    step_samples(result, config, tokenizer, samples)
    return metrics


def step_metrics(result: StepResult, config: TrainConfig, device: torch.device) -> dict[str, float]:
    """The metrics.jsonl line of one step (the module docstring lists its keys)."""
    g, s = result.generated, result.scored
    metrics: dict[str, float] = {"step": result.step}
    if config.rollout.workers.async_rollouts:
        metrics["rollout/staleness"] = float(g.stale)
    metrics.update(rollout_metrics(g.rollouts, s.scores, s.rewards, s.penalty, s.keep))
    times = {"rollout_s": g.seconds, "reward_s": s.seconds}
    if result.updated is None:
        metrics["skipped_update"] = 1.0
    else:
        metrics.update(result.updated.metrics)
        times.update(result.updated.times)
    if result.weight_update is not None:
        metrics.update(result.weight_update.metrics)
        times.update(result.weight_update.times)
    times["step_s"] = result.seconds
    metrics.update({f"time/{k}": v for k, v in times.items()})
    tokens = sum(len(r.response_ids) for r in g.rollouts)
    metrics["throughput/rollout_tokens_per_s"] = tokens / max(g.seconds, 1e-9)
    metrics["memory/peak_gib"] = peak_memory_bytes(device) / 2**30
    return metrics


def rollout_metrics(
    rollouts: list[Rollout],
    scores: torch.Tensor,
    rewards: torch.Tensor,
    penalty: torch.Tensor,
    keep: torch.Tensor,
) -> dict[str, float]:
    """Reward, length and batch metrics of one step's rollouts (the ``reward/``, ``response/`` and
    ``batch/`` keys of metrics.jsonl)."""
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "reward/score_mean": scores.float().mean().item(),
        "reward/overlong_penalty_mean": penalty.mean().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(r.finish_reason == "length" for r in rollouts)
        / len(rollouts),
        "batch/kept_frac": keep.float().mean().item(),
    }


def step_samples(result: StepResult, config: TrainConfig, tokenizer: Any, path: Path) -> None:
    """Append `run.samples_per_step` of the step's rollouts to samples.jsonl at `path` (printing
    three every `run.print_samples_every` steps)."""
    r, g = config.run, result.generated
    if not r.samples_per_step:
        return
    trainer_means = result.updated.trainer_means if result.updated is not None else {}
    record_samples(
        path,
        collect(
            result.step,
            [tokenizer.decode(ids) for ids in g.prompt_ids],
            [ex.answer for ex in g.examples],
            g.rollouts,
            result.scored.scores.tolist(),
            trainer_means,
            config.algo.group_size,
            r.samples_per_step,
        ),
        print_now=bool(r.print_samples_every) and result.step % r.print_samples_every == 0,
    )
