"""Issue 25, one home per rollout setting: quantization, engine, backend, shards and the Ray workers
all live in the ``rollout`` group (``rollout.workers`` is the worker pool's own config). Every old
name (a ``run.*`` field, a short flag) is refused as a flag, a YAML key, an override and a
``run.resume_allow_changes`` entry, naming the new one; a checkpoint whose config uses one resumes
only with ``--run.resume-allow-changes all``. Nothing here trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flashrl.rl.run
from flashrl.core.config import RolloutConfig, resolve_config
from flashrl.distributed.config import WorkersConfig
from flashrl.errors import CheckpointError, ConfigError
from flashrl.rl.config import field_names
from flashrl.rl.config_build import build_config, stored_values
from flashrl.rl.config_rollout import CORE_FIELDS, TrainRolloutConfig
from flashrl.rl.plan import check_resume_config
from flashrl.rl.renamed import MOVED
from flashrl.tools.cli import main

VALUES = {"backend": "vllm", "rollout_dtype": "fp32", "max_batch": "8", "worker_tp": "2"}
"""A valid value for the moved names whose default would not do (the rest take "1")."""


@pytest.fixture
def no_training(monkeypatch):
    seen = []
    monkeypatch.setattr(flashrl.rl.run, "run", seen.append)
    return seen


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_moved_name_has_a_home():
    assert set(MOVED.values()) <= set(field_names())
    assert {f"run.{n}" for n in ("backend", "rollout_dtype", "worker_tp")} <= set(MOVED)
    assert not [name for name in field_names() if name in MOVED]  # no old name is still a field


@pytest.mark.parametrize("old", sorted(MOVED))
def test_each_moved_flag_is_refused_naming_its_new_flag(old, no_training, capsys):
    value = VALUES.get(old.rpartition(".")[2], "1")
    assert main(["train", flag(old), value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flashrl train: error: {flag(old)} was renamed: use {flag(MOVED[old])}")
    assert len(err.splitlines()) == 1 and no_training == []


@pytest.mark.parametrize("old", sorted(name for name in MOVED if name.startswith("run.")))
def test_each_moved_yaml_key_and_override_is_refused(old, tmp_path):
    field = old.removeprefix("run.")
    message = f"{old} was renamed: use {MOVED[old]}"
    path = tmp_path / "c.yaml"
    for text in (f"run:\n  {field}: 1\n", f"{old}: 1\n"):  # nested and dotted
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"^{path}: {message}"):
            build_config("tiny-cpu", str(path), {})
    with pytest.raises(ConfigError, match=f"^overrides: {message}"):
        build_config("tiny-cpu", None, {old: "1"})
    with pytest.raises(ConfigError, match=f"^run.resume_allow_changes: {message}"):
        build_config("tiny-cpu", None, {"run.resume_allow_changes": f"run.seed,{old}"})


def test_worker_tp_names_vllm_s_own_argument(no_training, capsys):
    assert main(["train", "--run.worker-tp", "2"]) == 2
    assert (
        '--run.worker-tp was renamed: use --rollout.backend-kwargs with {"tensor_parallel_size": '
        "N} (vLLM's own argument)" in capsys.readouterr().err
    )


def old_checkpoint_config() -> dict:
    """The config.yaml a run of the tiny preset wrote before issue 25: the engine and worker
    settings under ``run``."""
    stored = build_config("tiny-cpu", None, {}).to_dict()
    rollout, run = stored["rollout"], stored["run"]
    workers = rollout.pop("workers")
    run |= {"backend": rollout.pop("backend"), "rollout_dtype": rollout.pop("dtype")}
    run |= {"max_batch": rollout.pop("max_batch"), "vllm_kwargs": rollout.pop("backend_kwargs")}
    run |= {"rollout_shards": rollout.pop("shards"), "rollout_workers": workers["count"]}
    run |= {"worker_tp": 1, "weight_payload": workers["payload"], "bucket_mb": 64}
    return stored


def test_a_checkpoint_in_the_old_names_resumes_only_with_allow_changes_all():
    stored = old_checkpoint_config()
    config = build_config("tiny-cpu", None, {"run.resume": "latest"})
    with pytest.raises(CheckpointError) as err:
        check_resume_config(config, Path("ckpt"), stored)
    message = str(err.value)
    assert message.startswith("ckpt stores its config under old names (run.backend (now ")
    for old in ("run.rollout_dtype (now rollout.dtype)", "run.worker_tp (now rollout.backend_"):
        assert old in message
    assert message.endswith(
        "pass --run.resume-allow-changes all to resume it without the comparison"
    )
    with pytest.raises(
        CheckpointError, match="run.rollout_workers \\(now rollout.workers.count\\)"
    ):
        stored_values(stored)
    anyway = build_config("tiny-cpu", None, {"run.resume_allow_changes": "all"})
    check_resume_config(anyway, Path("ckpt"), stored)  # the comparison is skipped
    current = build_config("tiny-cpu", None, {}).to_dict()
    check_resume_config(config, Path("ckpt"), current)  # today's names compare as before


def test_nested_yaml_flags_and_resume_fields_reach_the_workers_group(tmp_path, no_training):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  dtype: fp32\n  workers:\n    count: 2\n    payload: codes\n")
    argv = ["train", "--config", str(path), "--rollout.workers.bucket-mb", "1.5"]
    assert main([*argv, "--rollout.workers.async-rollouts"]) == 0
    r = no_training[0].rollout
    assert (r.dtype, r.workers) == (
        "fp32",
        WorkersConfig(count=2, payload="codes", bucket_mb=1.5, async_rollouts=True),
    )
    assert r.workers.bucket_bytes == int(1.5 * 2**20)
    again = build_config(None, str(no_training[0].save_yaml(tmp_path / "saved.yaml")), {})
    assert again == no_training[0]  # config.yaml round-trips, nested
    allowed = no_training[0].replace({"run.resume_allow_changes": "rollout.workers"})
    assert allowed.resume_allowed() == {
        n for n in field_names() if n.startswith("rollout.workers.")
    }
    with pytest.raises(ConfigError, match=r"rollout.workers must be a mapping of WorkersConfig"):
        build_config(None, None, {"rollout.workers": "2"})


def test_the_pool_gets_the_config_s_own_workers_object(monkeypatch):
    import flashrl.distributed.pool as pool_module
    from flashrl.rl.workers import make_rollouts

    class Pool:  # records what make_rollouts hands the pool (no Ray needed)
        def __init__(self, factory, config, device):
            self.config, self.device = config, device

    monkeypatch.setattr(pool_module, "WorkerPool", Pool)
    config = build_config("tiny-cpu", None, {"rollout.workers.count": 2})
    _, rollouts = make_rollouts(config, Path("unused"), torch.device("cpu"), None)
    assert rollouts.pool.config is config.rollout.workers and rollouts.pool.device == "cpu"
    assert rollouts.num_shards == 2  # rollout.shards 0: one per worker


def test_engines_read_only_the_core_rollout_config():
    rollout = build_config("tiny-cpu", None, {"rollout.dtype": "fp32"}).rollout
    core = rollout.as_rollout_config()
    assert type(core) is RolloutConfig and core.quant == "int8"
    assert [f for f in CORE_FIELDS if getattr(core, f) != getattr(rollout, f)] == []
    assert resolve_config(core) is core
    with pytest.raises(
        ConfigError,
        match=r"rollout_config: a TrainRolloutConfig holds fields a rollout engine does not read "
        r"\(dtype, backend, backend_kwargs, max_batch, shards, workers\); pass its RolloutConfig "
        r"part \(as_rollout_config\(\)\)",
    ):
        resolve_config(rollout, source="rollout_config")
    assert TrainRolloutConfig().quant == "int8"  # the training default; RolloutConfig's is bf16


@pytest.mark.parametrize(
    "values, match",
    [
        ({"rollout.dtype": "fp8"}, r"rollout.dtype='fp8' is invalid; allowed: bf16, fp16, fp32"),
        ({"rollout.max_batch": 0}, r"rollout.max_batch=0 is invalid; allowed: an integer >= 1"),
        ({"rollout.kv_cache_dtype": "int4"}, r"^rollout: kv_cache_dtype='int4' is invalid"),
        (
            {"rollout.backend_kwargs": "[1]"},
            r"rollout.backend_kwargs='\[1\]' must be a JSON object",
        ),
        ({"rollout.workers.threads": 0}, r"rollout.workers.threads=0 is invalid; allowed: an int"),
    ],
)
def test_rollout_errors_name_the_dotted_field(values, match):
    with pytest.raises(ConfigError, match=match):
        build_config("tiny-cpu", None, values)


def test_workers_config_checks_itself_when_built_directly():
    with pytest.raises(ConfigError, match=r"rollout.workers.address=5 is invalid; allowed: none"):
        WorkersConfig(address=5)
    with pytest.raises(ConfigError, match=r"rollout.workers.cpus='1' is not a number"):
        WorkersConfig(cpus="1")


@pytest.mark.parametrize(
    "fields",
    [{"payload": "delta"}, {"threads": 2, "cpus": 2.0}, {"address": "auto"}, {"bucket_mb": 8.0}],
)
def test_worker_settings_without_workers_are_refused_not_ignored(fields):
    """rollout.workers.count=0 generates in the trainer's process: a worker-only setting would be
    silently ignored there, so it is refused, naming each one."""
    with pytest.raises(ConfigError, match="no effect without rollout workers") as err:
        WorkersConfig(**fields)
    for name in fields:
        assert f"rollout.workers.{name}=" in str(err.value)
    assert WorkersConfig(count=1, **fields).count == 1


@pytest.mark.parametrize("address", ["host", "http://head:6379", "", "head:port"])
def test_a_malformed_ray_address_is_refused_before_anything_starts(address):
    with pytest.raises(ConfigError, match="allowed: none \\(a local Ray\\), 'auto', 'local'"):
        WorkersConfig(count=1, address=address)
    for good in ("auto", "local", "10.0.0.2:6379", "ray://head:10001", "[::1]:6379"):
        assert WorkersConfig(count=1, address=good).address == good
