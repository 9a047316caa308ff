"""The phases of one RL step (`flashrl.rl.phases`): each on hand-made inputs (score against values
computed by hand, sync's split of stats, the generator's seeds and async prefetch), then the trainer
with a scripted backend: a step without an informative group skips update and sync, and an update
uses only the kept rows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flashrl.core.rollout import Rollout
from flashrl.core.sampling import SamplingParams
from flashrl.rl.config import AlgoConfig
from flashrl.rl.config_build import build_config
from flashrl.rl.data import Example
from flashrl.rl.phases.generate import Generator
from flashrl.rl.phases.score import score
from flashrl.rl.phases.update import Learner
from flashrl.rl.phases.weight_update import update_rollout_weights
from flashrl.rl.trainer import Trainer
from flashrl.testing import save_tiny_model
from shorthand import dotted

SAMPLING = SamplingParams(max_tokens=4, n=4)


def rollout(text: str, length: int, prompt_index: int) -> Rollout:
    return Rollout([1, 2], [5] * length, text, [-1.0] * length, "stop", prompt_index=prompt_index)


# ------------------------------------------------------------------------------------ score


def two_groups() -> tuple[list[Example], list[Rollout]]:
    """Group 0: four right answers (rewards all 1, uninformative). Group 1: one right answer and
    three wrong ones, of 1, 1, 3 and 4 tokens."""
    examples = [Example("p0", "a"), Example("p1", "b")]
    texts = [("a", 1)] * 4 + [("b", 1), ("x", 1), ("x", 3), ("x", 4)]
    rollouts = [rollout(t, n, i // 4) for i, (t, n) in enumerate(texts)]
    return examples, rollouts


def exact(text: str, answer: str) -> float:
    return float(text == answer)


def test_score_rewards_advantages_and_keep_by_hand():
    examples, rollouts = two_groups()
    a = AlgoConfig(group_size=4, max_response_tokens=4, overlong_buffer=2, dynamic_sampling=True)
    s = score(examples, rollouts, exact, a)
    # overlong: 0 up to 4 - 2 tokens, then -(n - 2) / 2
    penalty = [0.0] * 6 + [-0.5, -1.0]
    rewards = [1.0] * 4 + [1.0, 0.0, -0.5, -1.0]
    mean = sum(rewards[4:]) / 4  # -0.125
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards[4:]) / 3)  # unbiased, as verl's GRPO
    advantages = [0.0] * 4 + [(r - mean) / (std + 1e-6) for r in rewards[4:]]
    assert s.scores.tolist() == [1.0] * 5 + [0.0] * 3
    assert s.penalty.tolist() == penalty and s.rewards.tolist() == rewards
    assert s.advantages.tolist() == pytest.approx(advantages, abs=1e-6)
    assert s.keep.tolist() == [False] * 4 + [True] * 4  # dynamic sampling drops group 0


def test_score_keeps_every_row_without_dynamic_sampling_and_rloo_scales():
    examples, rollouts = two_groups()
    a = AlgoConfig(group_size=4, max_response_tokens=4, advantage="rloo")
    s = score(examples, rollouts, exact, a)
    assert s.keep.tolist() == [True] * 8 and s.penalty.tolist() == [0.0] * 8
    # rloo: r_i minus the mean of the other three = 4/3 (r_i - group mean)
    assert s.advantages.tolist()[4:] == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


# --------------------------------------------------------------------------- weight update


class FakeRollouts:
    """A rollout source that records what it is sent and returns fixed weight-update stats."""

    def __init__(self, stats: dict | None = None) -> None:
        self.stats, self.updated, self.submitted = stats or {}, [], []

    def update_weights(self, named):
        self.updated.append([name for name, _ in named])
        return dict(self.stats)

    def submit(self, ids, params):
        self.submitted.append((ids, params.seed))
        return len(self.submitted) - 1

    def collect(self, handle):
        ids, _ = self.submitted[handle]
        return [rollout("r", 1, i) for i in range(len(ids))]


def test_weight_update_splits_the_sources_stats_into_metrics_and_times():
    stats = {"transfer_s": 0.1, "requantize_s": 0.2, "kv_calibration_s": 0.0, "sent_bytes": 123.0}
    stats |= {"q_changed_frac": 0.5, "delta_codes_frac": 0.25, "worker0/weight_update_s": 0.05}
    source = FakeRollouts(stats)
    done = update_rollout_weights(source, torch.nn.Linear(2, 2))
    assert source.updated == [["weight", "bias"]]
    assert done.metrics == {
        "weight_update/sent_bytes": 123.0,
        "weight_update/q_changed_frac": 0.5,
        "weight_update/delta_codes_frac": 0.25,
    }
    assert list(done.times) == [
        "weight_update_s", "transfer_s", "requantize_s", "kv_calibration_s",
        "worker0/weight_update_s",
    ]  # fmt: skip


# ------------------------------------------------------------------------------------ generate


WORKERS_ASYNC = "rollout.workers.async_rollouts"


class Prompts:
    def batch(self, step: int, size: int) -> list[Example]:
        return [Example(f"{step}-{i}", str(i)) for i in range(size)]


class CharTokenizer:
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize("async_rollouts", [False, True])
def test_generator_seeds_each_step_and_runs_one_ahead_when_async(async_rollouts):
    values = {"run.steps": 3, "run.seed": 2, "algo.batch_size": 8, "algo.group_size": 4}
    values |= {"algo.max_prompt_tokens": 2, "rollout.workers.count": 1}  # (async needs workers)
    config = build_config("tiny-cpu", None, values | {WORKERS_ASYNC: async_rollouts})
    source = FakeRollouts()
    gen = Generator(config, Prompts(), CharTokenizer(), source, SAMPLING)
    steps = [gen.generate(step) for step in range(3)]
    assert [g.examples[1].prompt for g in steps] == ["0-1", "1-1", "2-1"]
    assert steps[2].prompt_ids == [[ord("-"), ord("0")], [ord("-"), ord("1")]]  # the last 2
    assert [len(g.rollouts) for g in steps] == [2, 2, 2]
    # seeds in submission order: async submits step s + 1 inside generate(s), never step 3
    assert [seed for _, seed in source.submitted] == [2 * 1_000_003 + s for s in range(3)]
    assert [g.stale for g in steps] == ([False, True, True] if async_rollouts else [False] * 3)
    assert gen.pending == {}


# ------------------------------------------------------------------------------------ update


def test_learner_warms_the_learning_rate_up_linearly():
    config = build_config("tiny-cpu", None, {"algo.lr": 1.0, "algo.warmup_steps": 4})
    learner = Learner(None, None, None, config, SAMPLING, torch.device("cpu"))
    assert [learner.lr(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------ the trainer


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("policy"), "qwen2", tokenizer=True, max_position_embeddings=64
    )


class ScriptedBackend:
    """Every response is the text `texts(prompt, sample)`, one token long; counts weight updates."""

    def __init__(self, texts) -> None:
        self.texts, self.updates = texts, 0

    def generate(self, prompts, params):
        return [
            Rollout(list(p), [5], self.texts(i, j), [-1.0], "stop", prompt_index=i, sample_index=j)
            for i, p in enumerate(prompts)
            for j in range(params.n)
        ]

    def update_weights(self, named_tensors, **kwargs):
        self.updates += 1
        list(named_tensors)
        return {}

    def stats(self):
        return {}


def scripted_trainer(policy_dir, tmp_path, monkeypatch, texts) -> tuple[Trainer, ScriptedBackend]:
    from flashrl.rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "text_length", lambda response, answer: len(response))
    values = dict(model=str(policy_dir), output_dir=str(tmp_path / "run"), steps=1)
    values |= dict(batch_size=8, group_size=4, micro_batch_size=8, plot=False, lr=1e-2)
    values |= dict(reward="text_length", dynamic_sampling=True, samples_per_step=2)
    backend = ScriptedBackend(texts)
    return Trainer(build_config("tiny-cpu", None, dotted(values)), backend=backend), backend


def test_a_step_without_an_informative_group_skips_the_updates(policy_dir, tmp_path, monkeypatch):
    trainer, backend = scripted_trainer(policy_dir, tmp_path, monkeypatch, lambda i, j: "x")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = trainer.train_step()
    assert metrics["skipped_update"] == 1.0 and metrics["batch/kept_frac"] == 0.0
    assert backend.updates == 0, "no policy update, so no weight update"
    assert not [k for k in metrics if k.startswith(("actor/", "rollout_corr/", "weight_update/"))]
    assert [k for k in metrics if k.startswith("time/")] == [
        "time/rollout_s",
        "time/reward_s",
        "time/step_s",
    ]
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    assert trainer.step == 1


def test_an_update_uses_only_the_kept_rows(policy_dir, tmp_path, monkeypatch):
    # prompt 0, sample 0 answers "xx", every other response "x": only group 0 is informative
    texts = lambda i, j: "xx" if (i, j) == (0, 0) else "x"  # noqa: E731
    trainer, backend = scripted_trainer(policy_dir, tmp_path, monkeypatch, texts)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = trainer.train_step()
    assert "skipped_update" not in metrics and metrics["batch/kept_frac"] == 0.5
    assert backend.updates == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    samples = [json.loads(line) for line in trainer.samples_path.read_text().splitlines()]
    # one sample per group: the kept group's has the trainer's logprob, the dropped one's none
    assert [s["response"] for s in samples] == ["xx", "x"]
    assert samples[0]["trainer_logprob_mean"] < 0 and samples[1]["trainer_logprob_mean"] is None
