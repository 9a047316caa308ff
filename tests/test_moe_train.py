"""The MoE preset and routing replay in the training loop: the engine follows the trainer through
its own `named_parameters()` (fused 3-D experts), byte for byte against a fresh engine of the
trainer's checkpoint."""

from __future__ import annotations

import pytest
import torch

from flashrl.engine import Engine, EngineConfig
from flashrl.engine.routing import RoutingBackend
from flashrl.rl.checkpoint import read_metrics
from flashrl.rl.config_build import build_config
from flashrl.rl.presets import PRESETS, TINY_MOE_MODEL
from flashrl.rl.trainer import Trainer
from flashrl.testing import save_tiny_model
from test_moe_experts import assert_same


@pytest.fixture(autouse=True)
def text_length_reward(monkeypatch):
    """A reward a random model gets varied scores on (see tests/test_rl_trainer.py)."""
    from flashrl.rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "text_length", lambda response, answer: len(response) / 5)


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("moe-policy"),
        "qwen3_moe",
        tokenizer=True,
        max_position_embeddings=64,
    )


def moe_config(model_dir, out, **overrides):
    values = {
        "model": str(model_dir),
        "run.output_dir": str(out),
        "run.steps": 2,
        "algo.batch_size": 16,
        "algo.group_size": 4,
        "run.micro_batch_size": 8,
        "algo.max_response_tokens": 5,
        "run.plot": False,
        "algo.lr": 1e-2,
        "rollout.dtype": "fp32",
        "data.reward": "text_length",
    }
    values.update(overrides)
    return build_config("tiny-moe-cpu", None, values)


def test_preset_is_a_qwen3_moe_with_8_experts_top_2():
    preset = PRESETS["tiny-moe-cpu"]
    assert preset["model"] == "builtin:tiny-moe" and preset["rollout.quant"] == "int8"
    assert TINY_MOE_MODEL["num_experts"] == 8 and TINY_MOE_MODEL["num_experts_per_tok"] == 2
    assert TINY_MOE_MODEL["num_hidden_layers"] == 4


@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8_block"])
def test_train_step_syncs_experts_through_named_parameters(scheme, moe_policy, tmp_path):
    trainer = Trainer(moe_config(moe_policy, tmp_path / "run", **{"rollout.quant": scheme}))
    names = [n for n, _ in trainer.policy.named_parameters()]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    before = trainer.policy.model.layers[0].mlp.experts.down_proj.detach().clone()
    metrics = trainer.train_step()
    assert not torch.equal(before, trainer.policy.model.layers[0].mlp.experts.down_proj)
    saved = trainer.save_checkpoint()
    fresh = Engine(saved, scheme, EngineConfig(dtype="fp32", device="cpu", progress=False))
    assert_same(trainer.backend, fresh)
    assert "rollout_corr/k3_kl" in metrics


def test_routing_replay_option_in_the_loop(moe_policy, tmp_path):
    """`algo.routing_replay`: rollouts carry routing, the trainer replays it; bf16 scheme in an
    fp32 engine: the mismatch is fp32 rounding."""
    config = moe_config(
        moe_policy, tmp_path / "run", **{"rollout.quant": "bf16", "algo.routing_replay": True}
    )
    trainer = Trainer(config)
    assert isinstance(trainer.backend, RoutingBackend)
    trainer.train()
    rows = read_metrics(trainer.metrics_path)
    assert len(rows) == 2
    assert all(abs(m["rollout_corr/k3_kl"]) < 1e-6 for m in rows), rows
