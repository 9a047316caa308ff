"""Training-run state on disk: checkpoints load without running code, a run directory is never mixed
with another run, torn metrics lines and damaged checkpoints have a way forward, bad run settings
fail before any work (docs/reliability.md, "Training runs")."""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import torch

from flashrl.errors import CheckpointError, ConfigError
from flashrl.rl.config_build import build_config
from flashrl.rl.trainer import Trainer, read_metrics
from flashrl.testing import save_tiny_model
from shorthand import dotted


@pytest.fixture(autouse=True)
def text_length_reward(monkeypatch):
    """A reward a random model gets varied scores on (see test_rl_trainer.py)."""
    from flashrl.rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "text_length", lambda response, answer: len(response) / 5)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("policy"), "qwen2", tokenizer=True, max_position_embeddings=64
    )


def small_config(model_dir, out, **overrides):
    values = dict(
        model=str(model_dir),
        output_dir=str(out),
        steps=1,
        batch_size=8,
        group_size=4,
        micro_batch_size=8,
        max_response_tokens=4,
        task_max_operand=9,
        plot=False,
        lr=1e-2,
        device="cpu",
        dtype="fp32",
        reward="text_length",
    )
    values.update(overrides)
    return build_config("tiny-cpu", None, dotted(values))


def train(model_dir, out, **overrides) -> Trainer:
    trainer = Trainer(small_config(model_dir, out, **overrides))
    trainer.train()
    return trainer


def checkpoints(out) -> list[str]:
    return sorted(
        p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", ".checkpoint-"))
    )


# ------------------------------------------------------------------------------------ 1. no code execution


class _Evil:
    """Unpickling this object writes a marker file: what a planted trainer_state.pt could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["torch", "pickle"])
def test_planted_trainer_state_does_not_run(policy_dir, tmp_path, writer):
    out = tmp_path / "run"
    train(policy_dir, out)
    state, marker = out / "checkpoint-1" / "trainer_state.pt", tmp_path / "marker"
    if writer == "torch":
        torch.save({"step": 1, "payload": _Evil(marker)}, state)
    else:
        state.write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match="checkpoint-1/trainer_state.pt"):
        Trainer(small_config(policy_dir, out, steps=2, resume=str(out / "checkpoint-1")))
    with pytest.raises(CheckpointError, match="checkpoint-1/trainer_state.pt"):
        Trainer(small_config(policy_dir, out, steps=2, resume="latest"))
    assert not marker.exists(), "loading the checkpoint ran code from it"


def test_trainer_state_holds_only_plain_data(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out)
    state = torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1 and state["config"]["run"]["seed"] == 0


# ------------------------------------------------------------------------------------ 2. one run per directory


def test_fresh_run_refuses_a_directory_holding_a_run(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(
        CheckpointError, match=r"already holds a run .*metrics.jsonl.*checkpoint-1.*--run.overwrite"
    ):
        Trainer(small_config(policy_dir, out, seed=1))
    assert (out / "metrics.jsonl").read_text() == before and (out / "checkpoint-1").is_dir()
    (out / "notes.txt").write_text("mine")
    train(policy_dir, out, seed=1, steps=2, save_every=1, overwrite=True)
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert checkpoints(out) == ["checkpoint-1", "checkpoint-2"]
    assert (
        torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=True)["config"]["run"][
            "seed"
        ]
        == 1
    )
    assert (out / "notes.txt").read_text() == "mine", "overwrite deletes only the run's own files"


def test_resume_checks_the_config_against_the_checkpoint(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out)
    with pytest.raises(
        CheckpointError,
        match=r"(?s)group_size: 4 in the checkpoint, 8 now.*seed: 0 in the checkpoint, 3 now",
    ):
        Trainer(small_config(policy_dir, out, steps=2, resume="latest", seed=3, group_size=8))
    with pytest.raises(CheckpointError, match="rollout.quant"):
        Trainer(small_config(policy_dir, out, steps=2, resume="latest", quant="fp8"))
    # steps, lr and output settings may change; others with resume_allow_changes
    assert (
        Trainer(small_config(policy_dir, out, steps=3, lr=1e-3, save_every=1, resume="latest")).step
        == 1
    )
    assert (
        Trainer(
            small_config(
                policy_dir, out, steps=2, resume="latest", seed=3, resume_allow_changes="run.seed"
            )
        ).step
        == 1
    )
    assert (
        Trainer(
            small_config(
                policy_dir, out, steps=2, resume="latest", seed=3, resume_allow_changes="all"
            )
        ).step
        == 1
    )
    with pytest.raises(ConfigError, match="resume_allow_changes.*sede"):
        small_config(policy_dir, out, resume_allow_changes="sede")


def test_resume_from_another_directory_into_a_run_refuses(policy_dir, tmp_path):
    train(policy_dir, tmp_path / "a")
    train(policy_dir, tmp_path / "b")
    with pytest.raises(CheckpointError, match="already holds a run"):
        Trainer(
            small_config(
                policy_dir, tmp_path / "b", steps=2, resume=str(tmp_path / "a" / "checkpoint-1")
            )
        )


def test_resume_from_an_older_checkpoint_needs_overwrite(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out, steps=2, save_every=1)
    with pytest.raises(CheckpointError, match="checkpoint-2 .*newer.*--run.overwrite"):
        Trainer(small_config(policy_dir, out, steps=2, resume=str(out / "checkpoint-1")))
    Trainer(
        small_config(policy_dir, out, steps=2, resume=str(out / "checkpoint-1"), overwrite=True)
    )
    assert checkpoints(out) == ["checkpoint-1"]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0]


# ------------------------------------------------------------------------------------ 3. metrics.jsonl


def test_torn_last_metrics_line_is_dropped_on_resume(policy_dir, tmp_path, caplog):
    out = tmp_path / "run"
    train(policy_dir, out, steps=2, save_every=1)
    path = out / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 2, "reward/mean": 0.')  # a crash in the middle of step 2's line
    inode = os.stat(path).st_ino
    with caplog.at_level(logging.WARNING, logger="flashrl"):
        trainer = train(policy_dir, out, steps=3, resume="latest")
    assert "metrics.jsonl line 3" in caplog.text and "torn" in caplog.text
    assert [m["step"] for m in read_metrics(path)] == [0, 1, 2] and trainer.step == 3
    assert os.stat(path).st_ino != inode, "metrics.jsonl was rewritten in place, not replaced"


def test_torn_metrics_line_in_the_middle_is_an_error(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out, steps=2, save_every=1)
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0][:10] + "\n" + lines[1] + "\n")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl line 1"):
        Trainer(small_config(policy_dir, out, steps=3, resume="latest"))
    with pytest.raises(CheckpointError, match=r"metrics.jsonl line 1"):
        read_metrics(path)


def test_metrics_lines_are_appended_in_one_write(policy_dir, tmp_path, monkeypatch):
    """Each line goes to the file in one os.write followed by an fsync: a crash tears at most it."""
    calls = []
    real_write, real_fsync = os.write, os.fsync
    monkeypatch.setattr(
        os, "write", lambda fd, data: calls.append(("write", bytes(data))) or real_write(fd, data)
    )
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", None)) or real_fsync(fd))
    from flashrl.rl.durable import append_line

    path = tmp_path / "m.jsonl"
    append_line(path, '{"step": 0}')
    append_line(path, '{"step": 1}')
    assert calls == [
        ("write", b'{"step": 0}\n'),
        ("fsync", None),
        ("write", b'{"step": 1}\n'),
        ("fsync", None),
    ]
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'


# ------------------------------------------------------------------------------------ 4. damaged checkpoints


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer_state.pt", "config.json"])
def test_damaged_latest_checkpoint_falls_back(policy_dir, tmp_path, caplog, damaged):
    out = tmp_path / "run"
    train(policy_dir, out, steps=2, save_every=1)
    _truncate(out / "checkpoint-2" / damaged)
    with pytest.raises(CheckpointError, match=f"checkpoint-2/{damaged}"):
        Trainer(small_config(policy_dir, out, steps=3, resume=str(out / "checkpoint-2")))
    with caplog.at_level(logging.WARNING, logger="flashrl"):
        trainer = Trainer(small_config(policy_dir, out, steps=3, resume="latest"))
    assert trainer.step == 1
    assert f"checkpoint-2/{damaged}" in caplog.text and "checkpoint-1" in caplog.text
    assert (out / "checkpoint-2.damaged").is_dir() and not (out / "checkpoint-2").exists()
    trainer.train()
    assert checkpoints(out) == ["checkpoint-1", "checkpoint-2.damaged", "checkpoint-3"]
    Trainer(small_config(policy_dir, out, steps=3, resume=str(out / "checkpoint-3")))


def _flip_data_bytes(path):
    """Flip bytes in the middle of the tensor data: the safetensors header stays valid."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_found_by_the_manifest(policy_dir, tmp_path, caplog):
    """Bytes flipped inside model.safetensors still parse (safe_open accepts the file), but their
    SHA-256 differs from the checkpoint's manifest: resuming it is refused naming the file, and
    `latest` falls back to the previous checkpoint."""
    from safetensors import safe_open

    out = tmp_path / "run"
    train(policy_dir, out, steps=2, save_every=1)
    manifest = json.loads((out / "checkpoint-2" / "manifest.json").read_text())
    assert {"model.safetensors", "config.json", "trainer_state.pt"} <= set(manifest["files"])
    weights = out / "checkpoint-2" / "model.safetensors"
    _flip_data_bytes(weights)
    with safe_open(weights, "pt"):  # still a valid file: only the checksum can tell
        pass
    with pytest.raises(CheckpointError, match=r"checkpoint-2/model.safetensors: SHA-256 differs"):
        Trainer(small_config(policy_dir, out, steps=3, resume=str(out / "checkpoint-2")))
    with caplog.at_level(logging.WARNING, logger="flashrl"):
        trainer = Trainer(small_config(policy_dir, out, steps=3, resume="latest"))
    assert trainer.step == 1 and (out / "checkpoint-2.damaged").is_dir()
    assert "SHA-256 differs" in caplog.text


def test_a_checkpoint_without_a_manifest_still_resumes(policy_dir, tmp_path, caplog):
    """Checkpoints written before the manifest existed resume, checked structurally, and the log
    says so."""
    out = tmp_path / "run"
    train(policy_dir, out, steps=1, save_every=1)
    (out / "checkpoint-1" / "manifest.json").unlink()
    with caplog.at_level(logging.INFO, logger="flashrl"):
        trainer = Trainer(small_config(policy_dir, out, steps=2, resume="latest"))
    assert trainer.step == 1 and "no manifest.json" in caplog.text


def test_config_json_of_another_model_is_refused(policy_dir, tmp_path, tiny_models):
    """A checkpoint whose config.json was replaced by another model's (no manifest to catch it, as
    in an older checkpoint) is refused before anything loads, naming the fields that disagree."""
    out = tmp_path / "run"
    train(policy_dir, out, steps=1, save_every=1)
    checkpoint = out / "checkpoint-1"
    (checkpoint / "manifest.json").unlink()
    other = tiny_models("llama", hidden_size=32, num_hidden_layers=3)
    (checkpoint / "config.json").write_text((other / "config.json").read_text())
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-1/config.json: does not describe the weights beside it "
        r"\(.*hidden_size 32 .*num_hidden_layers 3 .*another model \(llama\)",
    ):
        Trainer(small_config(policy_dir, out, steps=2, resume=str(checkpoint)))


def test_no_complete_checkpoint_names_every_damaged_one(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out, steps=2, save_every=1)
    for step in (1, 2):
        _truncate(out / f"checkpoint-{step}" / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"(?s)no complete checkpoint.*checkpoint-2/model.safetensors.*"
        r"checkpoint-1/model.safetensors",
    ):
        Trainer(small_config(policy_dir, out, steps=3, resume="latest"))


def test_leftover_tmp_and_stray_final_directories(policy_dir, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Trainer(small_config(policy_dir, out, resume="latest"))
    train(policy_dir, out, steps=1)
    (out / ".checkpoint-7.tmp").mkdir()
    (out / ".checkpoint-7.tmp" / "model.safetensors").write_bytes(b"partial")
    (out / "checkpoint-final").mkdir()
    trainer = Trainer(small_config(policy_dir, out, steps=2, resume="latest"))
    assert trainer.step == 1
    assert not (out / ".checkpoint-7.tmp").exists(), (
        "an incomplete checkpoint write was left behind"
    )
    assert (out / "checkpoint-final").is_dir()


def test_keep_last(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out, steps=3, save_every=1, keep_last=2)
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="keep_last"):
            small_config(policy_dir, out, keep_last=bad)
    with pytest.raises(ConfigError, match="keep_last"):
        small_config(policy_dir, out, keep_last=0)


def test_failed_checkpoint_write_keeps_the_previous_one(policy_dir, tmp_path, monkeypatch):
    """A save that dies half-way on a full disk (here: while writing trainer_state.pt) is one error
    naming the checkpoint path, the space it needs and what is free; the partial write is removed,
    keep_last deletes nothing, the previous checkpoint is byte for byte intact, and the next resume
    continues."""
    out = tmp_path / "run"
    train(policy_dir, out, steps=1, keep_last=1)
    before = {p.name: p.read_bytes() for p in (out / "checkpoint-1").iterdir()}
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        CheckpointError,
        match=r"saving .*run/checkpoint-2: no space left on the device after [\d.]+ MiB; a "
        r"checkpoint needs about [\d.]+ MiB and [\d.]+ MiB are free; the partial write was "
        r"removed; checkpoint-1 is intact",
    ):
        train(policy_dir, out, steps=2, keep_last=1, resume="latest")
    assert checkpoints(out) == ["checkpoint-1"]
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-1").iterdir()} == before
    monkeypatch.setattr(torch, "save", real_save)
    trainer = train(policy_dir, out, steps=2, keep_last=1, resume="latest")
    assert trainer.step == 2 and checkpoints(out) == ["checkpoint-2"]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1]


def test_resume_at_the_last_step_does_not_rewrite_the_checkpoint(policy_dir, tmp_path):
    out = tmp_path / "run"
    train(policy_dir, out, steps=1)
    stamp = os.stat(out / "checkpoint-1" / "trainer_state.pt").st_mtime_ns
    train(policy_dir, out, steps=1, resume="latest")
    assert os.stat(out / "checkpoint-1" / "trainer_state.pt").st_mtime_ns == stamp


# ------------------------------------------------------------------------------------ 5-7. run settings


def test_compare_refuses_duplicates(policy_dir, tmp_path):
    from flashrl.rl.config import compare_variants

    with pytest.raises(ConfigError, match="'int8' twice"):
        compare_variants("int8,int8")
    with pytest.raises(ConfigError, match="twice"):
        compare_variants("bf16,INT8,int8")
    with pytest.raises(ConfigError, match="twice"):
        small_config(policy_dir, tmp_path / "cmp", compare="int8-notis,int8-notis")
    assert [name for name, _ in compare_variants("int8,int8-notis")] == ["int8", "int8-notis"]


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("FLASHRL_CONFIG", "int4", "FLASHRL_CONFIG='int4' is invalid"),
        ("FLASHRL_LMHEAD_FP32", "maybe", "FLASHRL_LMHEAD_FP32='maybe' is invalid"),
    ],
)
def test_train_validates_flashrl_env(policy_dir, tmp_path, monkeypatch, capsys, name, value, match):
    from flashrl.core.env import from_env
    from flashrl.rl.run import run
    from flashrl.tools.cli import main

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match) as other:
        from_env()  # what `flashrl generate` and the engine raise
    with pytest.raises(type(other.value), match=match):
        run(small_config(policy_dir, tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert (
        main(["train", "--model", str(policy_dir), "--run.output-dir", str(tmp_path / "run")]) == 2
    )
    assert match in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_output_dir_that_is_a_file(policy_dir, tmp_path):
    from flashrl.rl.run import run

    path = tmp_path / "out"
    path.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"output_dir.*{path}.*is a file"):
        Trainer(small_config(policy_dir, path))
    with pytest.raises(ConfigError, match=f"output_dir.*{path}.*is a file"):
        run(small_config(policy_dir, path / "sub", compare="bf16"))
    assert path.read_text() == "not a directory"


def test_full_disk_on_a_metrics_line_names_the_file(tmp_path, monkeypatch):
    from flashrl.rl.durable import append_line

    path = tmp_path / "metrics.jsonl"
    append_line(path, '{"step": 0}')

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(CheckpointError, match=r"appending to .*metrics.jsonl: no space left"):
        append_line(path, '{"step": 1}')
    monkeypatch.undo()
    assert path.read_text() == '{"step": 0}\n'


def test_a_renamed_checkpoint_says_which_step_it_holds(policy_dir, tmp_path):
    """Checkpoints are ordered by the step in their name: one renamed to look newer is refused,
    naming both steps, and `latest` falls back to the true newest."""
    out = tmp_path / "run"
    train(policy_dir, out, steps=2, save_every=1)
    (out / "checkpoint-1").rename(out / "checkpoint-7")
    with pytest.raises(CheckpointError, match=r"checkpoint-7: named for step 7 but holds step 1"):
        Trainer(small_config(policy_dir, out, steps=3, resume=str(out / "checkpoint-7")))
    assert Trainer(small_config(policy_dir, out, steps=3, resume="latest")).step == 2
