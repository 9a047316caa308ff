"""The update phase: the trainer's logprobs of the kept rows, the rollout correction, then the
policy update.

1. The trainer policy recomputes the logprobs (and entropy) of the rollout tokens at the rollout
   weights, replaying the rollout's temperature and top-k/top-p (`flashrl.rl.batch`); with a KL
   penalty the frozen reference does too. MoE with routing replay: the routers use the experts the
   rollout picked (`flashrl.rl.routing_replay`).
2. `flashrl.correction.compute_correction` turns trainer vs rollout logprobs into IS weights,
   rejection masks and mismatch metrics. Decoupled mode: the PPO ratio is taken against the
   trainer's own recompute and the weights correct pi_old / pi_rollout; bypass: the ratio is taken
   against the rollout logprobs and the weights only carry rejection.
3. `ppo_update`: one loss object, the `Objective` (`flashrl.rl.policy_loss`: the policy loss
   `algo.policy_loss` names, PPO-clip by default, and an optional k3 KL penalty to the reference),
   minimized over mini-batches of micro-batches with the correction's mask and weights, gradient
   clipping and one optimizer step per mini-batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashrl.core.rollout import Rollout
from flashrl.core.sampling import SamplingParams
from flashrl.correction.compute import Correction, compute_correction
from flashrl.rl.batch import Batch, response_logprobs
from flashrl.rl.config import TrainConfig
from flashrl.rl.phases.score import Scored
from flashrl.rl.policy_loss import Objective
from flashrl.rl.routing_replay import build_batch, replay_routing
from flashrl.utils import synchronize

LogprobsFn = Callable[[Batch], torch.Tensor]
"""The policy's logprobs of a (micro-)batch's response tokens, with gradients."""


@dataclass
class Updated:
    metrics: dict[str, float]
    """``rollout_corr/*`` and ``actor/*`` (entropy, the loss stats, grad_norm, lr)."""
    trainer_means: dict[int, float]
    """The trainer's mean logprob before the update, by rollout index (kept rows only)."""
    times: dict[str, float]
    """Seconds: ``logprobs`` (the recompute), ``train`` (the optimizer steps)."""


class Learner:
    """What the update phase trains: the policy, the frozen reference (None without a KL
    penalty) and the optimizer, with the run's settings and the `Objective` it minimizes."""

    def __init__(
        self,
        policy: torch.nn.Module,
        reference: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig,
        sampling: SamplingParams,
        device: torch.device,
        objective: Objective | None = None,
    ) -> None:
        self.policy, self.reference, self.optimizer = policy, reference, optimizer
        self.config, self.sampling, self.device = config, sampling, device
        self.objective = objective or Objective.from_algo(config.algo)
        """The loss object (default: the one `algo.*` names)."""

    def update(self, rollouts: list[Rollout], scored: Scored, step: int) -> Updated:
        """Update the policy on the rows `scored.keep` marks (at least one)."""
        kept = [i for i, k in enumerate(scored.keep.tolist()) if k]
        batch = build_batch(  # a ReplayBatch when the rollouts carry routing
            [rollouts[i] for i in kept], scored.advantages[scored.keep], self.device
        )
        start = time.perf_counter()
        self.policy.eval()
        with torch.no_grad():
            old, entropy = self.logprobs(self.policy, batch, with_entropy=True)
            ref = self.logprobs(self.reference, batch)[0] if self.reference is not None else None
        times = {"logprobs_s": time.perf_counter() - start}
        c = self.config.correction
        corr = compute_correction(old, batch.rollout_logprobs, batch.response_mask, c)
        ratio_base = old if c.mode == "decoupled" else batch.rollout_logprobs
        metrics = {f"rollout_corr/{k}": v for k, v in corr.metrics.items()}
        mask = batch.response_mask.to(old.dtype)
        means = (old * mask).sum(1).cpu() / mask.sum(1).clamp(min=1).cpu()
        metrics["actor/entropy"] = (entropy * batch.response_mask).sum().item() / max(
            batch.response_mask.sum().item(), 1
        )

        start = time.perf_counter()
        self.policy.train()
        lr = self.lr(step)
        a = self.config.algo
        steps = OptimizerSteps(a.mini_batches, self.config.run.micro_batch_size, a.grad_clip, lr)
        actor = ppo_update(
            self.policy,
            self.optimizer,
            UpdateBatch(batch, corr, ratio_base, ref),
            self.objective,
            lambda part: self.logprobs(self.policy, part)[0],
            steps,
        )
        synchronize(self.device)
        times["train_s"] = time.perf_counter() - start
        metrics.update({f"actor/{k}": v for k, v in actor.items()})
        metrics["actor/lr"] = lr
        return Updated(metrics, dict(zip(kept, means.tolist())), times)

    def logprobs(
        self, model: torch.nn.Module, batch: Batch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`model`'s logprobs (and entropies) of `batch`'s response tokens, micro-batch by
        micro-batch, under the rollout's sampling settings."""
        outs, ents = [], []
        micro = self.config.run.micro_batch_size
        for start in range(0, len(batch), micro):
            part = batch.select(slice(start, start + micro))
            with replay_routing(model, getattr(part, "routed_experts", None)):
                lp, ent = response_logprobs(model, part, self.sampling, with_entropy)
            outs.append(lp)
            ents.append(ent)
        return torch.cat(outs), (torch.cat(ents) if with_entropy else None)

    def lr(self, step: int) -> float:
        """`algo.lr`, warmed up linearly over the first `algo.warmup_steps` steps."""
        c = self.config.algo
        if c.warmup_steps > 0 and step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        return c.lr


@dataclass(frozen=True)
class UpdateBatch:
    """What one step's update trains on: the kept rows, their correction (mask and weights), the
    logprobs the ratio is taken against and the reference's (None without a KL penalty)."""

    batch: Batch
    corr: Correction
    ratio_base: torch.Tensor
    ref: torch.Tensor | None


@dataclass(frozen=True)
class OptimizerSteps:
    """How a batch becomes optimizer steps: `mini_batches` steps of `micro_batch_size`-row
    forward/backward passes, the gradient clipped to `grad_clip` (0: no clipping), at `lr`."""

    mini_batches: int
    micro_batch_size: int
    grad_clip: float
    lr: float


def ppo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: UpdateBatch,
    objective: Objective,
    logprobs: LogprobsFn,
    steps: OptimizerSteps,
) -> dict[str, float]:
    """Minimize `objective` over `data` in `steps.mini_batches` optimizer steps; returns the mean
    loss stats (``actor/*`` without the prefix) and ``grad_norm`` (mean over mini-batches)."""
    stats_sum: dict[str, float] = {}
    grad_norms: list[float] = []
    count = 0
    mini = len(data.batch) // steps.mini_batches
    for m in range(steps.mini_batches):
        rows = slice(m * mini, (m + 1) * mini)
        denominator = objective.denominator(data.corr.mask[rows])
        for lr_group in optimizer.param_groups:
            lr_group["lr"] = steps.lr
        for start in range(rows.start, rows.stop, steps.micro_batch_size):
            sub = slice(start, min(start + steps.micro_batch_size, rows.stop))
            part, corr = data.batch.select(sub), data.corr
            ref = data.ref[sub] if data.ref is not None else None
            loss, stats = objective(logprobs(part), data.ratio_base[sub], part.advantages,
                                    corr.mask[sub], corr.weights[sub], ref, denominator)  # fmt: skip
            loss.backward()
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + v
            count += 1
        max_norm = steps.grad_clip if steps.grad_clip > 0 else math.inf
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out = {k: v / count for k, v in stats_sum.items()}
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out
