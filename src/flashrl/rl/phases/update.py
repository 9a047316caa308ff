"""The policy update of one RL step: the policy loss `algo.policy_loss` names (PPO-clip by default;
`flashrl.rl.policy_loss`) over mini-batches of micro-batches, with the rollout
correction's mask and importance weights, an optional k3 KL penalty to a reference policy, gradient
clipping and one optimizer step per mini-batch (`ppo_update`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashrl.correction.compute import Correction
from flashrl.rl import algo
from flashrl.rl.batch import Batch
from flashrl.rl.config import AlgoConfig
from flashrl.rl.policy_loss import LossOptions, get_policy_loss

LogprobsFn = Callable[[Batch], torch.Tensor]
"""The policy's logprobs of a (micro-)batch's response tokens, with gradients."""


def ppo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    corr: Correction,
    ratio_base: torch.Tensor,
    ref: torch.Tensor | None,
    logprobs: LogprobsFn,
    algo_config: AlgoConfig,
    micro_batch_size: int,
    lr: float,
) -> dict[str, float]:
    """Run `algo_config.mini_batches` optimizer steps over `batch`; returns the mean loss stats
    (``actor/*`` without the prefix) and ``grad_norm`` (mean over mini-batches)."""
    c = algo_config
    stats_sum: dict[str, float] = {}
    grad_norms: list[float] = []
    count = 0
    mini = len(batch) // c.mini_batches
    for m in range(c.mini_batches):
        rows = slice(m * mini, (m + 1) * mini)
        mb_mask = corr.mask[rows]
        denominator = float(mb_mask.sum()) if c.loss_aggregation == "token_mean" else float(mini)
        for lr_group in optimizer.param_groups:
            lr_group["lr"] = lr
        for start in range(rows.start, rows.stop, micro_batch_size):
            sub = slice(start, min(start + micro_batch_size, rows.stop))
            loss, stats = _micro_loss(batch.select(sub), sub, corr, ratio_base, ref, logprobs, c,
                                      max(denominator, 1.0))  # fmt: skip
            loss.backward()
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + v
            count += 1
        max_norm = c.grad_clip if c.grad_clip > 0 else math.inf
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out = {k: v / count for k, v in stats_sum.items()}
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def _micro_loss(
    part: Batch,
    sub: slice,
    corr: Correction,
    ratio_base: torch.Tensor,
    ref: torch.Tensor | None,
    logprobs: LogprobsFn,
    c: AlgoConfig,
    denominator: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss (plus the KL penalty) of rows `sub`, scaled to the mini-batch."""
    lp = logprobs(part)
    options = LossOptions(
        c.clip_low, c.clip_high, c.dual_clip, c.loss_aggregation, denominator, c.max_response_tokens
    )
    policy_loss = get_policy_loss(c.policy_loss)
    loss, stats = policy_loss(
        lp, ratio_base[sub], part.advantages, corr.mask[sub], corr.weights[sub], options
    )
    if ref is not None:
        kl = algo.kl_penalty(lp, ref[sub], "k3")
        kl_loss = (kl * corr.mask[sub]).sum() / denominator
        loss = loss + c.kl_coef * kl_loss
        stats["kl_ref"] = kl_loss.item()
    return loss, stats
