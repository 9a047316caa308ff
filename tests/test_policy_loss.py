"""The policy-loss registry (`algo.policy_loss`): GSPO against a float64 re-implementation of verl's
``compute_policy_loss_gspo`` (loss and gradient to 1e-6 relative: the losses compute in fp32), REINFORCE against its on-policy
gradient ``-A grad log pi``, PPO-clip through the registry bit-identical to `ppo_clip_loss`, the
config's refusals; the loss object (`Objective`) against its formula in float64, `ppo_update`
minimizing a hand-made one, and the advantage registry taking a new estimator."""

from __future__ import annotations

import pytest
import torch

from flashrl.errors import ConfigError
from flashrl.rl.config import TrainConfig
from flashrl.rl.config_build import build_config
from flashrl.rl.loss import ppo_clip_loss
from flashrl.rl.policy_loss import POLICY_LOSSES, LossOptions, get_policy_loss


def batch(gen, b=6, t=9, spread=0.3):
    lengths = torch.tensor([9, 5, 1, 7, 9, 3])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(b, t, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    weights = torch.rand(b, t, generator=gen, dtype=torch.float64) + 0.5
    zero = ~mask
    return (
        lp.masked_fill(zero, 0),
        old.masked_fill(zero, 0),
        adv,
        mask,
        weights.masked_fill(zero, 0),
    )


def verl_gspo(old, lp, adv, mask, weights, clip_low, clip_high):
    """verl's compute_policy_loss_gspo, step for step, in float64 (agg: seq-mean-token-mean)."""
    m = mask.double()
    negative_approx_kl = lp - old
    seq_lengths = m.sum(-1).clamp(min=1)
    kl_seq = (negative_approx_kl * m).sum(-1) / seq_lengths
    log_s = (lp - lp.detach() + kl_seq.detach().unsqueeze(-1)).clamp(max=10.0)
    s = log_s.exp()
    a = adv.unsqueeze(-1).expand_as(lp)
    losses = torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high)) * weights
    seq_losses = (losses * m).sum(-1) / m.sum(-1).clamp(min=1)
    seq_mask = m.sum(-1) > 0
    return seq_losses[seq_mask].mean()


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_matches_verl(clip, gen):
    lp, old, adv, mask, weights = batch(gen)
    lp_a = lp.clone().requires_grad_()
    lp_b = lp.clone().requires_grad_()
    options = LossOptions(clip[0], clip[1], None, "seq_mean_token_mean")
    ours, stats = get_policy_loss("gspo")(lp_a, old, adv, mask, weights, options)
    ref = verl_gspo(old, lp_b, adv, mask, weights, *clip)
    ours.backward()
    ref.backward()
    assert abs(float(ours.detach()) - float(ref.detach())) <= 1e-6 * abs(float(ref.detach()))
    scale = lp_b.grad.abs().max()
    assert float((lp_a.grad - lp_b.grad).abs().max()) <= 1e-6 * float(scale)
    assert float(lp_a.grad[~mask].abs().max()) == 0.0
    if clip[0] < 1e-3:
        assert stats["pg_clipfrac"] > 0.5  # the paper's narrow range clips most sequences


def test_gspo_uses_one_ratio_per_sequence(gen):
    """Token ratios that differ within a sequence give one sequence ratio, the exp of their mean."""
    lp, old, adv, mask, _ = batch(gen)
    options = LossOptions(0.2, 0.28, None, "seq_mean_token_mean")
    _, stats = get_policy_loss("gspo")(lp, old, adv, mask, None, options)
    seq = ((lp - old) * mask).sum(-1) / mask.sum(-1)
    assert stats["seq_ratio_max"] == pytest.approx(float(seq.exp().max()), rel=1e-6)
    assert stats["seq_ratio_min"] == pytest.approx(float(seq.exp().min()), rel=1e-6)


def test_reinforce_on_policy_gradient(gen):
    """On-policy (old = current) the loss is -mean(A) per token and its gradient is
    ``-A / #tokens`` on every valid token: plain REINFORCE."""
    lp, _, adv, mask, _ = batch(gen)
    lp = lp.clone().requires_grad_()
    out, stats = get_policy_loss("reinforce")(
        lp, lp.detach(), adv, mask, None, LossOptions(aggregation="token_mean")
    )
    out.backward()
    a = adv.unsqueeze(-1).expand_as(lp)
    n = mask.sum()
    assert float(out.detach()) == pytest.approx(float(-(a * mask).sum() / n), rel=1e-6)
    assert torch.allclose(lp.grad, torch.where(mask, -a / n, 0.0), rtol=1e-6, atol=1e-9)
    assert "pg_clipfrac" not in stats and stats["ratio_mean"] == pytest.approx(1.0)


def test_reinforce_does_not_clip(gen):
    """Far off-policy ratios pass unclipped: the loss is -A r exactly."""
    lp, old, adv, mask, _ = batch(gen, spread=2.0)
    out, _ = get_policy_loss("reinforce")(lp, old, adv, mask, None, LossOptions())
    r = (lp - old).exp()
    expected = (-adv.unsqueeze(-1) * r * mask).sum() / mask.sum()
    assert float(out) == pytest.approx(float(expected), rel=1e-6)


def test_ppo_clip_through_the_registry_is_ppo_clip_loss(gen):
    lp, old, adv, mask, weights = batch(gen)
    options = LossOptions(0.2, 0.28, 10.0, "seq_mean_token_sum_norm", 4.0, 16)
    a, sa = get_policy_loss("ppo_clip")(lp, old, adv, mask, weights, options)
    b, sb = ppo_clip_loss(
        lp, old, adv, mask, weights, clip_low=0.2, clip_high=0.28, dual_clip=10.0,
        aggregation="seq_mean_token_sum_norm", loss_scale_denominator=4.0, max_length=16,
    )  # fmt: skip
    assert torch.equal(a, b) and sa == sb


def test_registry_and_config_refusals():
    assert list(POLICY_LOSSES) == ["ppo_clip", "gspo", "reinforce"]
    with pytest.raises(ConfigError, match="algo.policy_loss='gspo2' is invalid; allowed: ppo_clip"):
        get_policy_loss("gspo2")
    with pytest.raises(ConfigError, match="algo.policy_loss='x' is invalid"):
        build_config("tiny-cpu", None, {"algo.policy_loss": "x"})
    with pytest.raises(ConfigError, match="set algo.loss_aggregation seq_mean_token_mean"):
        build_config("tiny-cpu", None, {"algo.policy_loss": "gspo"})
    gspo = {"algo.policy_loss": "gspo", "algo.loss_aggregation": "seq_mean_token_mean"}
    with pytest.raises(ConfigError, match="dual_clip=10.0 does not apply to gspo"):
        build_config("tiny-cpu", None, {**gspo, "algo.dual_clip": "10"})
    assert isinstance(build_config("tiny-cpu", None, gspo), TrainConfig)


@pytest.mark.parametrize(
    "flags, stat",
    [
        (["--algo.policy-loss", "gspo", "--algo.loss-aggregation", "seq_mean_token_mean",
          "--algo.clip-low", "0.0003", "--algo.clip-high", "0.0004"], "actor/seq_ratio_mean"),
        (["--algo.policy-loss", "reinforce"], "actor/ratio_mean"),
    ],
)  # fmt: skip
def test_train_with_another_policy_loss(flags, stat, tmp_path, flashrl_logger):
    """`flashrl train` runs with each loss through the seam (nothing else changes) and logs its
    stats; PPO-clip's clip fractions appear only where a clip exists."""
    import json

    from flashrl.tools.cli import main

    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny-cpu", "--run.steps", "2", "--run.plot", "false"]
    assert main([*argv, "--run.output-dir", str(out), *flags]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(stat in r and r["actor/grad_norm"] > 0 for r in rows)
    assert all("actor/pg_clipfrac_dual" not in r for r in rows)


# ------------------------------------------------------------------------------------ the objective


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_objective_is_the_named_loss_plus_the_k3_penalty_in_float64(aggregation, gen):
    """`Objective.from_algo` + its call against the formula written out: the registered loss with
    the algo's clip range and the mini-batch's denominator, plus kl_coef * sum(k3 * mask) / denom,
    k3 = exp(ref - lp) - (ref - lp) - 1; the denominator is the valid tokens (token_mean) or the
    rows."""
    from flashrl.rl.policy_loss import Objective

    lp, old, adv, mask, weights = batch(gen)
    ref = lp + torch.randn(lp.shape, generator=gen, dtype=torch.float64) * 0.1
    values = {"algo.kl_coef": 0.3, "algo.clip_low": 0.1, "algo.loss_aggregation": aggregation}
    objective = Objective.from_algo(build_config("tiny-cpu", None, values).algo)
    denominator = objective.denominator(mask)
    assert denominator == (float(mask.sum()) if aggregation == "token_mean" else 6.0)
    got, stats = objective(lp, old, adv, mask, weights, ref, denominator)
    pg, _ = ppo_clip_loss(lp, old, adv, mask, weights, clip_low=0.1, clip_high=0.28,
                          aggregation=aggregation, loss_scale_denominator=denominator,
                          max_length=16)  # fmt: skip
    d = ref - lp
    kl = ((d.exp() - d - 1) * mask).sum() / denominator
    assert torch.allclose(got, pg + 0.3 * kl, rtol=1e-12, atol=0)
    assert stats["kl_ref"] == pytest.approx(float(kl), rel=1e-12)
    plain, plain_stats = objective(lp, old, adv, mask, weights, None, denominator)
    assert torch.equal(plain, pg) and "kl_ref" not in plain_stats
    assert objective.denominator(torch.zeros_like(mask)) == (
        1.0 if aggregation == "token_mean" else 6.0
    )


class Rows:
    """A stand-in batch of `n` rows: `ppo_update` reads its length, rows and advantages."""

    def __init__(self, n: int) -> None:
        self.n, self.advantages = n, torch.zeros(n)

    def __len__(self) -> int:
        return self.n

    def select(self, sub: slice) -> Rows:
        return Rows(len(range(*sub.indices(self.n))))


def test_ppo_update_minimizes_the_objective_it_is_given():
    """The seam of a new algorithm: `ppo_update` minimizes the loss object it is handed (here plain
    likelihood, -sum(lp * mask) / denominator, over a one-weight policy with lp = w - 1 per token),
    cutting 4 rows into 2 mini-batches of 1-row micro-batches, each scaled by its mini-batch's 6
    tokens: every micro-batch's gradient is -0.5, so each SGD step moves w by 0.1."""
    from types import SimpleNamespace

    from flashrl.rl.phases.update import OptimizerSteps, UpdateBatch, ppo_update
    from flashrl.rl.policy_loss import Objective

    denominators = []

    def likelihood(lp, old, adv, mask, weights, o):
        denominators.append(o.denominator)
        return -(lp * mask).sum() / o.denominator, {"pg_loss": 1.0}

    policy = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    corr = SimpleNamespace(mask=torch.ones(4, 3, dtype=torch.bool), weights=torch.ones(4, 3))
    data = UpdateBatch(Rows(4), corr, torch.zeros(4, 3), None)
    before = float(policy.weight.detach())
    stats = ppo_update(policy, optimizer, data, Objective(likelihood),
                       lambda part: policy.weight.expand(len(part), 3) - 1.0,
                       OptimizerSteps(mini_batches=2, micro_batch_size=1, grad_clip=0.0, lr=0.1))  # fmt: skip
    assert denominators == [6.0] * 4
    assert float(policy.weight.detach()) == pytest.approx(before + 0.2, abs=1e-6)
    assert stats == {"pg_loss": 1.0, "grad_norm": pytest.approx(1.0)}


def test_a_registered_advantage_estimator_is_selectable_by_name(monkeypatch):
    """The advantage registry: one function and one entry make `algo.advantage` accept the name
    and `group_advantages` run it (per group of `group_size` rows)."""
    from flashrl.rl import algo

    monkeypatch.setitem(
        algo.ADVANTAGES, "max_baseline", lambda g, norm, eps: g - g.max(1, True).values
    )
    config = build_config("tiny-cpu", None, {"algo.advantage": "max_baseline"})
    assert config.algo.advantage == "max_baseline"
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0])
    got = algo.group_advantages(rewards, 2, config.algo.advantage)
    assert torch.equal(got, torch.tensor([0.0, -1.0, 0.0, -1.0]))
    with pytest.raises(ConfigError, match="allowed: grpo, drgrpo, rloo, max_baseline"):
        build_config("tiny-cpu", None, {"algo.advantage": "max"})
