"""RL algorithm pieces as pure functions: advantages, reward shaping, group filtering, KL penalty.
The PPO-clip loss and the loss aggregations are in ``flashrl.rl.loss``.

Rewards come prompt-major: the `group_size` samples of a prompt are adjacent.

| estimator | advantage of sample i in group g                          | reference            |
|-----------|-----------------------------------------------------------|----------------------|
| `grpo`    | (r_i - mean_g) / (std_g + eps), or r_i - mean_g without std | DeepSeekMath (GRPO)  |
| `drgrpo`  | r_i - mean_g (pair with `seq_mean_token_sum_norm` loss)   | Dr. GRPO (Liu et al.) |
| `rloo`    | r_i - mean of the other samples = n/(n-1) (r_i - mean_g)  | Ahmadian et al.      |

`std_g` is the unbiased sample standard deviation, as in verl's GRPO.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashrl.errors import ConfigError, InputError
from flashrl.masked import LOG_RATIO_CLAMP

AdvantageFn = Callable[[torch.Tensor, bool, float], torch.Tensor]
"""(rewards [groups, group_size], norm_by_std, eps) -> advantages of the same shape."""


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise InputError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def grpo(g: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """(r_i - mean_g) / (std_g + eps); without `norm_by_std` (or with one sample) r_i - mean_g."""
    centered = g - g.mean(dim=1, keepdim=True)
    if norm_by_std and g.shape[1] > 1:
        return centered / (g.std(dim=1, keepdim=True) + eps)
    return centered


def drgrpo(g: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """r_i - mean_g, never divided by the std (Dr. GRPO's point); `norm_by_std` is ignored."""
    return g - g.mean(dim=1, keepdim=True)


def rloo(g: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """r_i - the mean of the group's other samples = n/(n-1) (r_i - mean_g)."""
    group_size = g.shape[1]
    if group_size < 2:
        raise ConfigError("rloo needs group_size >= 2")
    return (g - g.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)


ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}
"""The advantage estimators `algo.advantage` selects by name; a new one is a function of
`AdvantageFn`'s signature and a line here."""


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: str = "grpo",
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantages [N] from rewards [N] by the estimator `ADVANTAGES` names (module
    table)."""
    if estimator not in ADVANTAGES:
        raise ConfigError(
            f"advantage estimator {estimator!r} is invalid; allowed: {', '.join(ADVANTAGES)}"
        )
    return ADVANTAGES[estimator](_groups(rewards, group_size), norm_by_std, eps).reshape(-1)


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to rewards: 0 up to ``max_length - buffer`` tokens,
    then falling linearly to ``-factor`` at `max_length` (and below for longer responses)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    if buffer >= max_length:
        raise ConfigError(
            f"overlong buffer {buffer} must be smaller than the maximum length {max_length}"
        )
    start = max_length - buffer
    over = (lengths.float() - start).clamp(min=0)
    return -(over / buffer).clamp(max=1.0) * factor


def informative_groups(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """DAPO dynamic sampling: a bool mask [N] keeping the samples of groups whose rewards differ
    (a group with identical rewards has zero advantage everywhere and only dilutes the batch)."""
    g = _groups(rewards, group_size)
    keep = (g.max(dim=1).values - g.min(dim=1).values) > eps
    return keep.repeat_interleave(group_size)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate: `k1` = lp - lp_ref;
    `k3` = exp(lp_ref - lp) - (lp_ref - lp) - 1 (non-negative, low variance; GRPO's choice);
    `k2` = (lp - lp_ref)^2 / 2."""
    diff = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return -diff
    if kind == "k2":
        return diff.pow(2) / 2
    if kind == "k3":
        return diff.exp() - diff - 1
    raise ConfigError(f"KL estimator {kind!r} is invalid; allowed: k1, k2, k3")
