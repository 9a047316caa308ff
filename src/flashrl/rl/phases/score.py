"""The score phase: rewards, advantages and the rows the update keeps.

reward = task score (`algo`'s reward function on the response text and the example's answer)
+ DAPO's overlong penalty (`flashrl.rl.algo.overlong_penalty`); advantages are group-normalised by
the estimator `algo.advantage` names (`flashrl.rl.algo.group_advantages`); with
`algo.dynamic_sampling` only groups whose rewards differ are kept (DAPO), else every row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flashrl.core.rollout import Rollout
from flashrl.rl import algo
from flashrl.rl.config import AlgoConfig
from flashrl.rl.data import Example
from flashrl.rl.rewards import RewardFn


@dataclass
class Scored:
    """Per-rollout tensors [N] of one step (prompt-major, as the rollouts)."""

    scores: torch.Tensor
    """The reward function's task score."""
    penalty: torch.Tensor
    """The overlong penalty (0 or negative)."""
    rewards: torch.Tensor
    """scores + penalty: what the advantages are computed from."""
    advantages: torch.Tensor
    keep: torch.Tensor
    """bool: rows the update uses (all unless dynamic sampling drops uniform groups)."""
    seconds: float


def score(
    examples: list[Example], rollouts: list[Rollout], reward_fn: RewardFn, a: AlgoConfig
) -> Scored:
    """Score `rollouts` (rollout i answers `examples[rollouts[i].prompt_index]`)."""
    start = time.perf_counter()
    scores = torch.tensor([reward_fn(r.text, examples[r.prompt_index].answer) for r in rollouts])
    lengths = torch.tensor([len(r.response_ids) for r in rollouts])
    penalty = algo.overlong_penalty(
        lengths, a.max_response_tokens, a.overlong_buffer, a.overlong_penalty
    )
    rewards = scores + penalty
    advantages = algo.group_advantages(rewards, a.group_size, a.advantage, a.norm_adv_by_std)
    keep = (
        algo.informative_groups(rewards, a.group_size)
        if a.dynamic_sampling
        else torch.ones(len(rollouts), dtype=torch.bool)
    )
    return Scored(scores, penalty, rewards, advantages, keep, time.perf_counter() - start)
