"""The policy losses a run can select by name (`algo.policy_loss`): one registry, one signature.

| name        | per-token loss (before the correction weight and aggregation)            | reference |
|-------------|---------------------------------------------------------------------------|-----------|
| `ppo_clip`  | ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, optional dual clip | PPO, DAPO clip-higher (`flashrl.rl.loss`) |
| `gspo`      | the same clip on the sequence ratio ``s = exp(mean_t log r_t)``           | GSPO (`flashrl.rl.gspo`) |
| `reinforce` | ``-A r`` (no clip): the importance-weighted policy gradient               | REINFORCE / on-policy GRPO |

Every loss takes the current and old logprobs ``[B, T]``, advantages ``[B]`` or ``[B, T]``, the
response mask, the correction's per-token weights (or None) and `LossOptions`, and returns
``(scalar loss, float stats)``. Adding an algorithm is one module with such a function and one line
in `POLICY_LOSSES`.

`Objective` is the loss object the update phase runs (`flashrl.rl.phases.update.ppo_update`): the
selected loss with its options, plus the KL penalty to the reference policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flashrl.errors import ConfigError
from flashrl.masked import LOG_RATIO_CLAMP, to_floats
from flashrl.rl import algo, gspo, loss
from flashrl.rl.loss import LossOptions

__all__ = ["POLICY_LOSSES", "LossOptions", "Objective", "PolicyLoss", "get_policy_loss"]


PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, LossOptions],
    tuple[torch.Tensor, dict[str, float]],
]


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    o: LossOptions,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`flashrl.rl.loss.ppo_clip_loss` with the options of `o`."""
    return loss.ppo_clip_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        weights,
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        dual_clip=o.dual_clip,
        aggregation=o.aggregation,
        loss_scale_denominator=o.denominator,
        max_length=o.max_length,
    )


def reinforce(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    o: LossOptions,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``-A r`` per token with ``r = exp(clamp(logprobs - old_logprobs))``, no clip: on-policy
    (r = 1) its gradient is ``-A grad log pi``, plain REINFORCE / GRPO."""
    loss.check_loss_options(0.0, 0.0, None, o.aggregation, o.denominator, o.max_length)
    x = loss.LossInputs.build(logprobs, old_logprobs, advantages, mask, weights)
    log_ratio = (x.lp - x.lp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token = -x.adv * torch.exp(log_ratio)
    weighted = per_token if x.w is None else per_token * x.w
    out = loss.aggregate(weighted, x.valid, o.aggregation, o.denominator, o.max_length)
    with torch.no_grad():
        ratio = log_ratio.detach().exp()
        stats = {
            "pg_loss": out.detach(),
            "ppo_kl": -x.valid.mean(log_ratio.detach()),
            "ratio_mean": x.valid.masked_mean(ratio),
            "is_weight_mean": x.valid.mean(x.w) if x.w is not None else 1.0,
        }
    return out, to_floats(stats)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo.gspo_loss,
    "reinforce": reinforce,
}


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss called `name`; a ConfigError naming the registered ones otherwise."""
    try:
        return POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"algo.policy_loss={name!r} is invalid; allowed: {', '.join(POLICY_LOSSES)}"
        ) from None


@dataclass(frozen=True)
class Objective:
    """What one micro-batch of the update minimizes: `policy_loss` with `options` (the
    denominator is the mini-batch's, given per call), plus ``kl_coef`` times the mean k3 KL to the
    reference policy when its logprobs are given. `from_algo` builds the one an `AlgoConfig`
    names; another objective can be handed to `flashrl.rl.phases.update.Learner` directly."""

    policy_loss: PolicyLoss
    options: LossOptions = dataclasses.field(default_factory=LossOptions)
    kl_coef: float = 0.0

    @classmethod
    def from_algo(cls, a: Any) -> Objective:
        """The objective of `AlgoConfig` `a`: its policy loss, clip range, aggregation, KL."""
        options = LossOptions(
            a.clip_low, a.clip_high, a.dual_clip, a.loss_aggregation, None, a.max_response_tokens
        )
        return cls(get_policy_loss(a.policy_loss), options, a.kl_coef)

    def denominator(self, mask: torch.Tensor) -> float:
        """What a mini-batch's loss is divided by (mask: its rows): its valid tokens under
        ``token_mean``, else its rows; at least 1."""
        token_mean = self.options.aggregation == "token_mean"
        return max(float(mask.sum()) if token_mean else float(mask.shape[0]), 1.0)

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        denominator: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch, scaled to its mini-batch's `denominator`, and its stats
        (``kl_ref`` too with a reference)."""
        options = dataclasses.replace(self.options, denominator=denominator)
        out, stats = self.policy_loss(logprobs, old_logprobs, advantages, mask, weights, options)
        if ref_logprobs is not None:
            kl = algo.kl_penalty(logprobs, ref_logprobs, "k3")
            kl_loss = (kl * mask).sum() / denominator
            out = out + self.kl_coef * kl_loss
            stats["kl_ref"] = kl_loss.item()
        return out, stats
