"""The trainer: config parsing, one step end to end, weight sync into the engine, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from flashrl.errors import ConfigError
from flashrl.rl.config import TrainConfig
from flashrl.rl.config_build import build_config
from flashrl.rl.trainer import Trainer, read_metrics
from flashrl.testing import save_tiny_model
from flashrl.tools.cli import main
from flashrl.tools.train import parse_overrides
from shorthand import dotted


@pytest.fixture(autouse=True)
def text_length_reward(monkeypatch):
    """A reward a random model gets varied scores on (the task reward would be 0 for every sample,
    so advantages and gradients would vanish)."""
    from flashrl.rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "text_length", lambda response, answer: len(response) / 5)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("policy"), "qwen2", tokenizer=True, max_position_embeddings=64
    )


def small_config(model_dir, out, **overrides) -> TrainConfig:
    """The tiny-cpu preset on `model_dir`, shortened; `overrides` by field name (``steps=3``, the
    name inside its group)."""
    values = dict(
        model=str(model_dir),
        output_dir=str(out),
        steps=2,
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
    )
    values.update(overrides)
    return build_config("tiny-cpu", None, dotted(values))


# ------------------------------------------------------------------------------------ config


def test_yaml_and_overrides_merge_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"run": {"steps": 7}, "algo": {"lr": 0.5}, "rollout": {"quant": "fp8"}})
    )
    overrides = parse_overrides(
        ["--algo.lr", "0.25", "--run.plot=false", "--algo.dynamic-sampling"]
    )
    config = build_config("tiny-cpu", str(path), overrides)
    assert (
        config.run.steps,
        config.algo.lr,
        config.rollout.quant,
        config.run.plot,
        config.algo.dynamic_sampling,
    ) == (7, 0.25, "fp8", False, True)
    assert config.algo.group_size == 8  # from the preset


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            {"algo.batch_size": "12", "algo.group_size": "8"},
            "batch_size=12 is not divisible by algo.group_size=8",
        ),
        (
            {"rollout.quant": "int4"},
            "rollout: unknown quantization scheme 'int4'; allowed: bf16, int8",
        ),
        ({"run.steps": "two"}, "steps='two' is not an integer"),
        ({"run.plot": "maybe"}, "plot='maybe' is not a boolean"),
        ({"learning_rate": "1"}, r"unknown config key\(s\) in overrides: learning_rate"),
        ({"correction.weight": "token_mis", "correction.band": "2_1"}, "band"),
        ({"correction.cap": "0.5"}, "cap"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        build_config("tiny-cpu", None, overrides)


def test_config_file_and_preset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_config(None, str(tmp_path / "nope.yaml"), {})
    with pytest.raises(ValueError, match="unknown preset 'huge'; allowed: tiny-cpu"):
        build_config("huge", None, {})
    assert (
        main(["train", "--algo.batch-size", "10", "--algo.group-size", "4"]) == 2
    )  # clean CLI error, no traceback


def test_importance_weights_default_to_token_tis_and_turn_off_by_weight_none():
    assert TrainConfig().correction.weight == "token_tis" and TrainConfig().correction.cap == 2.0
    assert build_config(None, None, {"correction.weight": "none"}).correction.weight == "none"
    with pytest.raises(ConfigError, match="tis_cap 0 is now correction.weight none"):
        build_config(None, None, {"tis_cap": 0})  # flashrl 0.1's way is refused, not translated


# ------------------------------------------------------------------------------------ training


def test_one_step_updates_weights_and_syncs_the_engine(policy_dir, tmp_path):
    trainer = Trainer(small_config(policy_dir, tmp_path / "run", quant="bf16"))
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    metrics = trainer.train_step()
    changed = [k for k, v in trainer.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the optimizer step changed no weight"
    ids = list(range(5, 25))
    with torch.no_grad():
        trainer_logits = trainer.policy(torch.tensor([ids])).logits[0]
    # bf16 scheme in an fp32 engine: the engine must hold exactly the trainer's new weights
    assert (trainer.backend.logits(ids) - trainer_logits).abs().max() < 1e-4
    for key in (
        "reward/mean",
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "actor/pg_loss",
        "time/rollout_s",
        "time/train_s",
        "time/transfer_s",
        "time/requantize_s",
        "throughput/rollout_tokens_per_s",
        "memory/peak_gib",
    ):
        assert key in metrics, key
    assert all(k.endswith("_s") for k in metrics if k.startswith("time/"))  # the stats schema
    assert (
        abs(metrics["rollout_corr/kl"]) < 1e-4
    )  # fp32 engine and fp32 trainer on the same weights


def test_int8_engine_follows_the_trainer(policy_dir, tmp_path):
    trainer = Trainer(small_config(policy_dir, tmp_path / "run", quant="int8", lr=5e-2))
    ids = list(range(5, 25))
    stale = trainer.backend.logits(ids)
    trainer.train_step()
    with torch.no_grad():
        fresh = trainer.policy(torch.tensor([ids])).logits[0]
    synced = trainer.backend.logits(ids)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(synced, fresh) < 0.05, (
        "int8 engine logits should match the trainer within quantization error"
    )
    assert rel(synced, fresh) < 0.2 * rel(stale, fresh), "the engine still serves the old weights"


def test_dynamic_sampling_and_overlong_penalty(policy_dir, tmp_path):
    trainer = Trainer(
        small_config(
            policy_dir,
            tmp_path / "run",
            dynamic_sampling=True,
            overlong_buffer=2,
            overlong_penalty=0.5,
        )
    )
    metrics = trainer.train_step()
    # a random model never answers: rewards are 0 apart from the penalty, so only groups whose
    # penalties differ are kept
    assert 0.0 <= metrics["batch/kept_frac"] <= 1.0
    assert (
        metrics["reward/overlong_penalty_mean"] < 0
    )  # 5-token responses sit in the 2-token buffer


def test_resume_equals_uninterrupted(policy_dir, tmp_path):
    full = Trainer(small_config(policy_dir, tmp_path / "full", steps=3, save_every=2))
    full.train()
    resumed = Trainer(
        small_config(
            policy_dir,
            tmp_path / "full",
            steps=3,
            resume=str(tmp_path / "full" / "checkpoint-2"),
            output_dir=str(tmp_path / "resumed"),
        )
    )
    assert resumed.step == 2
    resumed.train()
    a, b = (
        read_metrics(tmp_path / "full" / "metrics.jsonl")[2],
        read_metrics(tmp_path / "resumed" / "metrics.jsonl")[-1],
    )
    for key in (
        "reward/mean",
        "rollout_corr/kl",
        "actor/pg_loss",
        "actor/grad_norm",
        "response/length_mean",
    ):
        assert a[key] == b[key], key
    for (name, p), q in zip(full.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(p, q), name


def test_checkpoint_loads_in_engine_and_transformers(policy_dir, tmp_path):
    import transformers

    from flashrl.engine import Engine, EngineConfig

    trainer = Trainer(small_config(policy_dir, tmp_path / "run", steps=1))
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoint-1"
    ids = list(range(5, 20))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt)(torch.tensor([ids])).logits[0]
    engine = Engine(ckpt, engine_config=EngineConfig(dtype="fp32", device="cpu", progress=False))
    assert (engine.logits(ids) - hf).abs().max() < 1e-4
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 0


def test_bad_inputs(policy_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file .*missing.jsonl.* does not exist"):
        Trainer(small_config(policy_dir, tmp_path / "a", path=str(tmp_path / "missing.jsonl")))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match="fields found: problem, solution"):
        Trainer(small_config(policy_dir, tmp_path / "b", path=str(data)))
    no_tok = save_tiny_model(tmp_path / "no-tok", "qwen2")
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        Trainer(small_config(no_tok, tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="model directory .* does not exist"):
        Trainer(small_config(tmp_path / "nope", tmp_path / "d"))


def test_compare_runs_each_precision(policy_dir, tmp_path):
    from flashrl.rl.run import run

    rows = run(
        small_config(policy_dir, tmp_path / "cmp", steps=1, compare="bf16,int8-notis", plot=True)
    )
    assert [r["run"] for r in rows] == ["bf16", "int8-notis"]
    assert (tmp_path / "cmp" / "compare.png").is_file() and (
        tmp_path / "cmp" / "compare.json"
    ).is_file()
    notis = yaml.safe_load((tmp_path / "cmp" / "int8-notis" / "config.yaml").read_text())
    assert notis["correction"]["weight"] == "none" and notis["rollout"]["quant"] == "int8"


@pytest.mark.slow
def test_tiny_preset_reward_rises(tmp_path, monkeypatch):
    """The default job, shortened: int8 rollouts with TIS raise the mean reward by a clear margin
    (the tiny model is built from scratch, as on a fresh machine)."""
    monkeypatch.setenv("FLASHRL_CACHE", str(tmp_path / "cache"))
    config = build_config(
        "tiny-cpu",
        None,
        {"run.steps": 100, "run.output_dir": str(tmp_path / "tiny"), "run.plot": False},
    )
    assert config.data.reward == "exact_match"
    assert (
        config.rollout.quant == "int8"
        and config.correction.weight == "token_tis"
        and config.correction.cap == 2.0
    )
    trainer = Trainer(config)
    trainer.train()
    rewards = [m["reward/mean"] for m in read_metrics(trainer.metrics_path)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward {first:.3f} -> {last:.3f}"


def test_rollout_config_file_supplies_the_scheme(tmp_path):
    from flashrl.core.config import RolloutConfig

    path = RolloutConfig(quant="fp8_channel", skip=("lm_head", "*.down_proj")).to_yaml(
        tmp_path / "flashrl.yaml"
    )
    config = build_config("tiny-cpu", None, {"rollout.file": str(path)})
    assert config.rollout.quant == "fp8_channel" and config.rollout.skip == (
        "lm_head",
        "*.down_proj",
    )
    explicit = build_config("tiny-cpu", None, {"rollout.file": str(path), "rollout.quant": "int8"})
    assert explicit.rollout.quant == "int8"  # an explicit flag still wins
