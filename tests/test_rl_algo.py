"""Advantages, reward shaping, group filtering and KL penalties against plain-Python references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from flashrl.rl import algo


def reference_advantages(
    rewards: list[float], n: int, estimator: str, norm_by_std: bool
) -> list[float]:
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = sum(group) / n
        for r in group:
            if estimator == "rloo":
                out.append(r - (sum(group) - r) / (n - 1))
            elif estimator == "grpo" and norm_by_std:
                out.append((r - mean) / (statistics.stdev(group) + 1e-6))
            else:
                out.append(r - mean)
    return out


@pytest.mark.parametrize(
    "estimator,norm", [("grpo", True), ("grpo", False), ("drgrpo", True), ("rloo", True)]
)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_group_advantages_match_reference(estimator, norm, n, gen):
    rewards = (
        torch.randint(0, 3, (n * 5,), generator=gen).float()
        + torch.rand(n * 5, generator=gen) * 0.1
    )
    got = algo.group_advantages(rewards, n, estimator, norm)
    ref = reference_advantages(rewards.tolist(), n, estimator, norm)
    assert torch.allclose(got, torch.tensor(ref), atol=1e-5)


def test_identical_rewards_give_zero_advantage():
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4)
    for estimator in algo.ADVANTAGES:
        assert torch.equal(algo.group_advantages(rewards, 4, estimator), torch.zeros(8))


def test_advantage_errors():
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        algo.group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="allowed: grpo, drgrpo, rloo"):
        algo.group_advantages(torch.zeros(8), 4, "ppo")


def test_overlong_penalty_is_dapo_soft_punishment():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    got = algo.overlong_penalty(lengths, max_length=16, buffer=4, factor=0.5)
    # start of the buffer at 12: 0 until 12, linear to -0.5 at 16, capped below
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]))
    assert torch.equal(algo.overlong_penalty(lengths, 16, 0), torch.zeros(5))
    with pytest.raises(ValueError, match="smaller than the maximum length"):
        algo.overlong_penalty(lengths, 16, 16)


def test_informative_groups_drop_constant_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    assert algo.informative_groups(rewards, 3).tolist() == [True] * 3 + [False] * 3 + [False] * 3


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty(kind, gen):
    lp = -torch.rand(20, generator=gen) * 3
    ref = -torch.rand(20, generator=gen) * 3
    got = algo.kl_penalty(lp, ref, kind)
    d = (ref - lp).double()
    expected = {"k1": -d, "k2": d**2 / 2, "k3": d.exp() - d - 1}[kind]
    assert torch.allclose(got.double(), expected, atol=1e-6)
    assert torch.equal(algo.kl_penalty(lp, lp, kind), torch.zeros(20))
    if kind == "k3":
        assert (got >= 0).all()
    with pytest.raises(ValueError, match="allowed: k1, k2, k3"):
        algo.kl_penalty(lp, ref, "k4")


def test_kl_k3_mean_estimates_true_kl():
    """Samples from pi: mean k3 over samples approaches KL(pi || pi_ref) (unbiased estimator)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(10, generator=gen), 0)
    q = torch.softmax(torch.randn(10, generator=gen), 0)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    est = algo.kl_penalty(p.log()[samples], q.log()[samples], "k3").mean().item()
    true = (p * (p.log() - q.log())).sum().item()
    assert math.isclose(est, true, rel_tol=0.03)
