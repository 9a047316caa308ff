"""GSPO (Group Sequence Policy Optimization, Zheng et al. 2025, arXiv 2507.18071): the PPO clip on
a sequence-level importance ratio.

For sequence ``i`` with ``|y_i|`` response tokens::

    s_i = exp( (1/|y_i|) * sum_t (log pi(y_it) - log pi_old(y_it)) )     (length-normalized)
    s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]                              (value s_i, gradient per token)
    l_it = max(-A_i s_it, -A_i clip(s_it, 1 - eps_low, 1 + eps_high))
    loss = seq_mean_token_mean(w_it * l_it)

as verl's ``compute_policy_loss_gspo`` (``verl/trainer/ppo/core_algos.py``): the log of ``s_it`` is
clamped above at 10, the rollout-correction weight multiplies each token, and the aggregation is
always ``seq_mean_token_mean`` (`flashrl.rl.config` refuses another). The paper's clip range is
``eps_low = 3e-4``, ``eps_high = 4e-4`` (set `algo.clip_low` / `algo.clip_high`); dual clip does
not apply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashrl.masked import to_floats
from flashrl.rl import loss

if TYPE_CHECKING:
    from flashrl.rl.loss import LossOptions

LOG_RATIO_MAX = 10.0
"""Upper clamp of ``log s_it``, as verl's GSPO."""


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    o: LossOptions,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GSPO loss and its stats (``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, ``seq_ratio_*``)."""
    loss.check_loss_options(o.clip_low, o.clip_high, None, o.aggregation, o.denominator, None)
    x = loss.LossInputs.build(logprobs, old_logprobs, advantages, mask, weights)
    token_log_ratio = x.lp - x.lp_old  # 0 on padding
    seq_log_ratio = token_log_ratio.sum(-1) / x.valid.n.clamp_min(1.0)
    log_s = (x.lp - x.lp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=LOG_RATIO_MAX)
    s = torch.exp(log_s)
    unclipped = -x.adv * s
    clipped = -x.adv * s.clamp(1.0 - o.clip_low, 1.0 + o.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    weighted = per_token if x.w is None else per_token * x.w
    out = loss.aggregate(weighted, x.valid, "seq_mean_token_mean", o.denominator, None)
    with torch.no_grad():
        seq_ratio = seq_log_ratio.detach().exp()
        has_tokens = x.valid.n > 0
        stats = {
            "pg_loss": out.detach(),
            "pg_clipfrac": x.valid.frac(clipped.detach() > unclipped.detach()),
            "ppo_kl": -x.valid.mean(token_log_ratio.detach()),
            "seq_ratio_mean": seq_ratio[has_tokens].mean() if has_tokens.any() else 1.0,
            "seq_ratio_max": seq_ratio[has_tokens].max() if has_tokens.any() else 1.0,
            "seq_ratio_min": seq_ratio[has_tokens].min() if has_tokens.any() else 1.0,
            "is_weight_mean": x.valid.mean(x.w) if x.w is not None else 1.0,
        }
    return out, to_floats(stats)
