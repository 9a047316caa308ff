"""The rollout-backend seam (`flashrl.rl.backends`): a toy backend registered from outside
`flashrl.rl` drives a whole `flashrl train` run through the `RolloutBackend` protocol alone, and the
registry refuses unknown and shadowing names."""

from __future__ import annotations

import json

import pytest

import flashrl.rl.backends as backends
from flashrl.core.rollout import RolloutBackend
from flashrl.engine import Engine, EngineConfig
from flashrl.errors import ConfigError
from flashrl.rl.config_build import build_config
from flashrl.tools.cli import main


class ToyBackend:
    """Only the protocol: generate, update_weights, stats (an engine inside does the work), and
    counts of each call."""

    def __init__(self, request: backends.BackendRequest) -> None:
        rollout = request.config.rollout
        engine_config = EngineConfig(device=request.device, dtype=rollout.dtype,
                                     max_len=request.max_len, max_batch=request.max_batch,
                                     progress=False)  # fmt: skip
        self.engine = Engine(request.model_dir, rollout.as_rollout_config(), engine_config)
        self.calls = {"generate": 0, "update_weights": 0}
        ToyBackend.last = self

    def generate(self, prompts, params):
        self.calls["generate"] += 1
        return self.engine.generate(prompts, params)

    def update_weights(self, named_tensors):
        self.calls["update_weights"] += 1
        return self.engine.update_weights(named_tensors)

    def stats(self):
        return self.engine.stats()


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, "toy", ToyBackend)  # removed again after the test
    return ToyBackend


def test_a_registered_backend_runs_a_training_run(toy, tmp_path, flashrl_logger):
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny-cpu", "--run.steps", "2", "--run.plot", "false"]
    assert main([*argv, "--rollout.backend", "toy", "--run.output-dir", str(out)]) == 0
    assert isinstance(toy.last, RolloutBackend)
    assert toy.last.calls == {"generate": 2, "update_weights": 2}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(0 <= r["reward/mean"] <= 1 for r in rows)


def test_registry_refusals(toy):
    assert backends.backend_names()[:2] == ("builtin", "vllm") and "toy" in backends.backend_names()
    with pytest.raises(ConfigError, match="'toy' is already registered; pass replace=True"):
        backends.register_backend("toy", ToyBackend)
    with pytest.raises(ConfigError, match="non-empty name and a callable"):
        backends.register_backend("", ToyBackend)
    with pytest.raises(
        ConfigError, match=r"rollout.backend='sglang' is invalid; allowed: builtin, vllm"
    ):
        build_config("tiny-cpu", None, {"rollout.backend": "sglang"})
