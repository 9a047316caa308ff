"""The per-step metrics the trainer computes from a step's rollouts and rewards."""

from __future__ import annotations

import torch

from flashrl.core.rollout import Rollout


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
