"""Sharding seeds and the weight transport: a gloo broadcast (bf16/fp32 stream or trainer-side
codes) leaves every worker's codes and scales identical to an in-process `update_weights`."""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from distributed_fixtures import ray_instance  # noqa: F401 (fixture)
from flashrl.core.config import RolloutConfig
from flashrl.core.sampling import SamplingParams
from flashrl.distributed.rollouts import LocalRollouts
from flashrl.distributed.sharding import assign, shard_bounds, shard_seed
from flashrl.engine.engine import Engine, EngineConfig
from flashrl.engine.sampler import stream_seed
from flashrl.model.weights import iter_checkpoint
from flashrl.testing import save_tiny_model


def test_shard_seed_reproduces_every_requests_stream():
    for seed in (0, 7, 2**63 - 5):
        for first in (0, 1, 5, 1000):
            for i, j in ((0, 0), (3, 2), (17, 7)):
                assert stream_seed(shard_seed(seed, first), i, j) == stream_seed(seed, first + i, j)
    assert shard_seed(123, 0) == 123  # one shard is exactly today's call
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]
    assert assign(5, 2) == [[0, 2, 4], [1, 3]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    old = save_tiny_model(root / "a", "qwen2", tokenizer=True, max_position_embeddings=64)
    new = save_tiny_model(root / "b", "qwen2", seed=1, tokenizer=True, max_position_embeddings=64)
    return old, new


def engine_factory(path, quant="int8"):
    """A picklable engine factory (a worker cannot import this test module)."""
    engine_config = EngineConfig(
        dtype="fp32", device="cpu", max_batch=8, max_len=32, progress=False
    )
    return functools.partial(Engine, path, quant, engine_config)


def make_engine(path, quant="int8"):
    return engine_factory(path, quant)()


def test_sharded_generation_keeps_tokens_and_one_shard_is_todays_call(models):
    engine = make_engine(models[0])
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=11)
    whole = engine.generate(prompts, params)
    one = LocalRollouts(engine, 1)
    same = one.collect(one.submit(prompts, params))
    assert [(r.response_ids, r.logprobs) for r in whole] == [
        (r.response_ids, r.logprobs) for r in same
    ]
    three = LocalRollouts(engine, 3)
    split = three.collect(three.submit(prompts, params))
    assert [r.response_ids for r in split] == [r.response_ids for r in whole]
    assert [(r.prompt_index, r.sample_index) for r in split] == [
        (i, j) for i in range(4) for j in range(2)
    ]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_instance")
@pytest.mark.parametrize(
    "payload,dtype",
    [("stream", torch.bfloat16), ("codes", torch.bfloat16), ("codes", torch.float32)],
)
def test_gloo_sync_matches_an_in_process_update(models, payload, dtype):
    from flashrl.distributed.config import WorkersConfig
    from flashrl.distributed.pool import WorkerPool

    old, new = models
    named = [(n, t.to(dtype)) for n, t in iter_checkpoint(new)]
    reference = make_engine(old)
    reference.update_weights(named)
    expected = reference.model.state_dict()
    factory = engine_factory(old)
    config = WorkersConfig(count=2, payload=payload, bucket_mb=4099 / 2**20, timeout=600)
    assert config.bucket_bytes == 4099  # a bucket boundary inside most tensors
    pool = WorkerPool(factory, config)
    try:
        before = pool.call("state")[0]
        out = pool.update_weights(named)
        states = pool.call("state")
    finally:
        pool.shutdown()
    changed = [k for k in expected if not torch.equal(before[k], expected[k])]
    assert any(k.endswith("weight_scale") for k in changed) and len(changed) > 10
    for state in states:
        assert state.keys() == expected.keys()
        for k, v in expected.items():
            assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    full = sum(t.numel() * t.element_size() for _, t in named)
    codes = sum(t.numel() + 4 * t.shape[0] for n, t in named if n in pool.quantized)
    linears = sum(t.numel() * t.element_size() for n, t in named if n in pool.quantized)
    assert out["sent_bytes"] == (full if payload == "stream" else full - linears + codes)
    assert out["worker1/requantize_s"] > 0


def test_nested_worker_flags_parse_into_the_workers_group(monkeypatch):
    """``--rollout.workers.count 2`` and friends land in `config.rollout.workers` (the object
    `WorkerPool` is given: tests/test_rollout_group.py); the short flags of issue 14 name their
    new flags."""
    import flashrl.rl.run
    from flashrl.errors import ConfigError
    from flashrl.tools.cli import main
    from flashrl.tools.train import parse_overrides

    seen = []
    monkeypatch.setattr(flashrl.rl.run, "run", seen.append)
    tokens = ["--rollout.workers.count", "2", "--rollout.workers.address", "auto"]
    assert main(["train", *tokens, "--rollout.workers.async-rollouts"]) == 0
    w = seen[0].rollout.workers
    assert (w.count, w.address, w.async_rollouts) == (2, "auto", True)
    for old, new in [
        ("--rollout-workers", "--rollout.workers.count"),
        ("--ray-address", "--rollout.workers.address"),
        ("--async-rollouts", "--rollout.workers.async-rollouts"),
    ]:
        with pytest.raises(ConfigError, match=f"^{old} was renamed: use {new}$"):
            parse_overrides([old, "1"])


def test_without_ray_the_flags_give_the_install_hint(models, tmp_path, monkeypatch, capsys):
    from flashrl.tools.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "run"
    args = ["train", "--model", str(models[0]), "--run.output-dir", str(out)]
    code = main([*args, "--rollout.workers.count", "2", "--run.device", "cpu", "--run.steps", "1"])
    assert code != 0
    assert "pip install 'flashrl[ray]'" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


@pytest.mark.ray
@pytest.mark.usefixtures("ray_instance")
def test_a_hanging_worker_is_named_within_the_deadline():
    import time

    import ray

    from flashrl.distributed.config import WorkersConfig
    from flashrl.distributed.pool import RolloutWorkerError, WorkerPool

    pool = WorkerPool.__new__(WorkerPool)  # only the deadline logic: no actors needed
    pool.ray, pool.config = ray, WorkersConfig(count=2, timeout=2.0)

    def nap(seconds: float) -> None:  # local, so Ray pickles it by value
        import time

        time.sleep(seconds)

    sleep = ray.remote(num_cpus=0)(nap)
    futures = [sleep.remote(0), sleep.remote(60)]
    start = time.perf_counter()
    with pytest.raises(RolloutWorkerError, match="rollout worker 1 did not generate within 2 s"):
        pool.wait(futures, "generate")
    assert time.perf_counter() - start < 10
    ray.cancel(futures[1], force=True)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_instance")
def test_workers_recalibrate_fp8_kv_scales_like_the_engine(models):
    """fp8 KV cache with calibrated scales: after generating and a stream sync, a worker's KV scales
    (recalibrated on its recent sequences) equal an in-process engine's after the same calls."""
    from flashrl.distributed.config import WorkersConfig
    from flashrl.distributed.pool import WorkerPool
    from flashrl.distributed.rollouts import PoolRollouts

    old, new = models
    kv = RolloutConfig(quant="int8", kv_cache_dtype="fp8", kv_scale="calibrated")
    factory = engine_factory(old, kv)
    named = [(n, t.float()) for n, t in iter_checkpoint(new)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
    reference = factory()
    local = LocalRollouts(reference, 1)
    expected_rollouts = local.collect(local.submit(prompts, params))
    before = reference.kv_scales.k.clone()
    reference.update_weights(named)
    pool = WorkerPool(factory, WorkersConfig(count=1, timeout=600))
    try:
        remote = PoolRollouts(pool, 1)
        rollouts = remote.collect(remote.submit(prompts, params))
        out = pool.update_weights(named)
        state = pool.call("state")[0]
    finally:
        pool.shutdown()
    assert [r.response_ids for r in rollouts] == [r.response_ids for r in expected_rollouts]
    assert out["kv_calibration_s"] > 0
    assert not torch.equal(before, reference.kv_scales.k)  # new weights, new scales
    assert torch.equal(state["kv_scales.k"], reference.kv_scales.k)
    assert torch.equal(state["kv_scales.v"], reference.kv_scales.v)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            {"rollout.workers.async_rollouts": True},
            "rollout.workers.async_rollouts needs rollout.workers.count >= 1",
        ),
        ({"rollout.workers.count": -1}, "rollout.workers.count=-1"),
        ({"rollout.workers.payload": "fp8"}, "allowed: stream, codes"),
        ({"rollout.workers.bucket_mb": 0}, "rollout.workers.bucket_mb=0.0 is out of range"),
        ({"rollout.shards": -1}, "rollout.shards=-1"),
        ({"rollout.backend_kwargs": '{"tensor_parallel_size": 2}'}, "builtin engine takes none"),
        ({"run.worker_tp": 2}, 'use rollout.backend_kwargs with {"tensor_parallel_size": N}'),
    ],
)
def test_worker_config_errors_name_the_field(overrides, match):
    from flashrl.errors import ConfigError
    from flashrl.rl.config_build import build_config

    with pytest.raises(ConfigError, match=match):
        build_config("tiny-cpu", None, overrides)
