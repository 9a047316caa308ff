"""Training with rollout workers on a local Ray instance: the same bits as in-process for 1 and 2
workers (with a checkpoint and a resume), a killed worker is named and the last checkpoint stays
loadable, async rollouts run one step stale and still learn."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from distributed_fixtures import ray_instance  # noqa: F401 (fixture)
from flashrl.rl import checkpoint as ckpt
from flashrl.rl.config_build import build_config
from flashrl.rl.trainer import Trainer, read_metrics
from flashrl.testing import save_tiny_model
from shorthand import dotted

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_instance")]
LAYOUT = ("time/", "throughput/", "memory/", "weight_update/")
"""Metric prefixes that describe the machine, not what the run computed."""


@pytest.fixture(autouse=True)
def text_length_reward(monkeypatch):
    """A reward a random model gets varied scores on (as in test_rl_trainer)."""
    from flashrl.rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "text_length", lambda response, answer: len(response) / 5)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("policy"), "qwen2", tokenizer=True, max_position_embeddings=64
    )


WORKERS = "rollout.workers.count"


def config(model_dir, out, **overrides):
    values = dict(
        model=str(model_dir),
        output_dir=str(out),
        steps=3,
        batch_size=16,
        group_size=4,
        micro_batch_size=8,
        max_response_tokens=5,
        task_max_operand=9,
        plot=False,
        lr=1e-2,
        device="cpu",
        dtype="fp32",
        reward="text_length",
        shards=2,
    )
    values.update(overrides)
    if values.get(WORKERS):  # a worker setting without workers is refused
        values.setdefault("rollout.workers.timeout", 120.0)
    return build_config("tiny-cpu", None, dotted(values))


def computed(path):
    """metrics.jsonl without the layout keys (times, memory, bytes)."""
    return [{k: v for k, v in m.items() if not k.startswith(LAYOUT)} for m in read_metrics(path)]


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_workers_give_the_bits_of_the_in_process_run(policy_dir, tmp_path, quant):
    local = Trainer(config(policy_dir, tmp_path / "local", quant=quant, save_every=2))
    local.train()
    one = Trainer(config(policy_dir, tmp_path / "one", quant=quant, **{WORKERS: 1}))
    one.train()
    two = Trainer(config(policy_dir, tmp_path / "two", quant=quant, **{WORKERS: 2}, steps=2))
    two.train()
    resumed = Trainer(
        config(policy_dir, tmp_path / "two", quant=quant, **{WORKERS: 2}, resume="latest")
    )
    assert resumed.step == 2
    resumed.train()
    expected = computed(local.metrics_path)
    assert len(expected) == 3 and expected[0]["reward/std"] > 0
    assert computed(one.metrics_path) == expected
    assert computed(resumed.metrics_path) == expected
    two_metrics = read_metrics(resumed.metrics_path)
    assert all(
        m["weight_update/sent_bytes"] > 0 and "time/worker1/weight_update_s" in m
        for m in two_metrics
    )
    for (name, p), q, r in zip(
        local.policy.named_parameters(), one.policy.parameters(), resumed.policy.parameters()
    ):
        assert torch.equal(p, q) and torch.equal(p, r), name


def test_killed_worker_is_named_and_the_checkpoint_survives(policy_dir, tmp_path, monkeypatch):
    import ray

    from flashrl.distributed.pool import RolloutWorkerError
    from flashrl.engine.engine import Engine, EngineConfig

    out = tmp_path / "run"
    trainer = Trainer(config(policy_dir, out, **{WORKERS: 2}, steps=5, save_every=2))
    step = Trainer.train_step

    def kill_then_step(self):
        if self.step == 3:
            ray.kill(self.rollouts.pool.workers[1])
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", kill_then_step)
    with pytest.raises(RolloutWorkerError, match="rollout worker 1 died"):
        trainer.train()
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2]
    assert ckpt.verify_checkpoint(out / "checkpoint-2")["step"] == 2
    Engine(out / "checkpoint-2", "int8", EngineConfig(device="cpu", max_len=32, progress=False))
    assert len(read_metrics(out / "metrics.jsonl")) == 3


def test_async_rollouts_run_one_step_stale_and_learn(tmp_path):
    """The tiny task, shortened, with generation one step ahead on one worker: staleness 1 from
    the second step on, and the reward still rises (decoupled IS against the rollout logprobs)."""
    overrides = {"run.steps": 60, "run.output_dir": str(tmp_path / "async"), "run.plot": False}
    overrides |= {WORKERS: "1", "rollout.workers.async_rollouts": "true"}
    overrides["rollout.workers.timeout"] = 300
    trainer = Trainer(build_config("tiny-cpu", None, overrides))
    assert (
        trainer.config.rollout.workers.async_rollouts
        and trainer.config.correction.mode == "decoupled"
    )
    trainer.train()
    metrics = read_metrics(trainer.metrics_path)
    assert [m["rollout/staleness"] for m in metrics] == [0.0] + [1.0] * 59
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward {first:.3f} -> {last:.3f}"


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this Python"
)
def test_a_worker_that_cannot_build_its_backend_says_why():
    """A worker whose backend fails in its constructor (here: vLLM missing in the worker's Python,
    the real check `make_backend` runs) is named with that cause, not only as a dead actor."""
    from flashrl.distributed.config import WorkersConfig
    from flashrl.distributed.pool import RolloutWorkerError, WorkerPool
    from flashrl.vllm_backend.install_check import require_vllm

    factory = functools.partial(require_vllm, "rollout.backend=vllm")
    with pytest.raises(
        RolloutWorkerError,
        match=r"rollout worker 0 died during 'start' \(its backend failed to start: "
        r"UnsupportedError: rollout.backend=vllm needs vLLM, which is not installed",
    ):
        WorkerPool(factory, WorkersConfig(count=1, cpus=1, timeout=600))
