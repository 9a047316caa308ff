"""The `flashrl` command's error contract: a bad input gives one line `flashrl <cmd>: error: <message>` and
exit code 2 before any work starts; a bug in flashrl (a plain KeyError / ValueError / TypeError) keeps its
traceback. Every test here runs `flashrl.tools.cli.main` in-process; none loads a real model unless it says so."""

from __future__ import annotations

import errno
import json
import math
import os
from types import SimpleNamespace

import pytest
import yaml

import flashrl.engine
import flashrl.tools.bench
import flashrl.tools.cli as cli
import flashrl.tools.profile
import flashrl.tools.setup
import flashrl.tools.verify
from flashrl.core.env import ENV_VARS
from flashrl.errors import (
    CheckpointError,
    ConfigError,
    FlashRLError,
    InputError,
    UnsupportedError,
    WeightError,
)
from flashrl.tools.cli import UserError, main


@pytest.fixture(autouse=True)
def _clean(flashrl_logger, monkeypatch):
    """main() configures the `flashrl` logger and reads FLASHRL_*: keep both out of other tests."""
    for name in (*ENV_VARS, "FLASHRL_QUANT_KERNELS"):
        monkeypatch.delenv(name, raising=False)


def _fail_if_called(*args, **kwargs):
    raise AssertionError("the command started its work although an argument was bad")


def one_line_error(capsys, command: str) -> str:
    """The single stderr line of a refused command, without its `flashrl <cmd>: error: ` prefix."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flashrl {command}: error: "), err
    assert "Traceback" not in err
    return lines[0].removeprefix(f"flashrl {command}: error: ")


# ------------------------------------------------------------------------------------------------
# which exceptions are one line, which keep their traceback
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        KeyError("layers.0.q_proj"),
        ValueError("bug"),
        TypeError("bug"),
        AttributeError("bug"),
        ConnectionError("no filename"),
    ],
)
def test_internal_errors_keep_their_traceback(monkeypatch, error):
    def run(args):
        raise error

    monkeypatch.setattr(cli, "run_verify", run)
    with pytest.raises(type(error)):
        main(["verify", "--device", "cpu"])


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("bad config"),
        InputError("bad input"),
        WeightError("bad tensor"),
        CheckpointError("bad checkpoint"),
        UnsupportedError("cannot here"),
        FlashRLError("base"),
        UserError("old name"),
    ],
)
def test_flashrl_errors_are_one_line_and_exit_2(monkeypatch, capsys, error):
    def run(args):
        raise error

    monkeypatch.setattr(cli, "run_verify", run)
    assert main(["verify", "--device", "cpu"]) == 2
    assert one_line_error(capsys, "verify") == str(error)
    with pytest.raises(type(error)):  # -v shows the traceback
        main(["-v", "verify", "--device", "cpu"])


def test_user_error_is_a_flashrl_error():
    assert issubclass(UserError, FlashRLError)


def test_yaml_safetensors_and_path_errors_are_one_line(monkeypatch, capsys, tmp_path):
    from safetensors import SafetensorError

    cases = [
        (
            yaml.YAMLError("mapping values are not allowed here"),
            "mapping values are not allowed here",
        ),
        (SafetensorError("Error while deserializing header: HeaderTooLarge"), "HeaderTooLarge"),
        (
            FileNotFoundError(
                errno.ENOENT, "No such file or directory", str(tmp_path / "w.safetensors")
            ),
            f"{tmp_path / 'w.safetensors'}: No such file or directory",
        ),
        (
            IsADirectoryError(errno.EISDIR, "Is a directory", str(tmp_path)),
            f"{tmp_path}: Is a directory",
        ),
        (
            NotADirectoryError(errno.ENOTDIR, "Not a directory", "/etc/hostname/x"),
            "/etc/hostname/x: Not a directory",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/root/x"),
            "/root/x: Permission denied",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device", "/data/ckpt"),
            "/data/ckpt: No space left on device",
        ),
        (
            FileNotFoundError("dataset file 'x.jsonl' does not exist"),
            "dataset file 'x.jsonl' does not exist",
        ),
    ]
    for error, message in cases:

        def run(args, error=error):
            raise error

        monkeypatch.setattr(cli, "run_verify", run)
        assert main(["verify", "--device", "cpu"]) == 2
        assert message in one_line_error(capsys, "verify")


def test_a_damaged_safetensors_file_is_one_line(tmp_path, capsys):
    """A real loader error: the checkpoint's weight file is garbage."""
    from flashrl.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "qwen2")
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"\xff" * 64)
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--device", "cpu", "--prompt-ids", "1,2"]) == 2
    one_line_error(capsys, "generate")


# ------------------------------------------------------------------------------------------------
# outputs are checked before the work starts, and written atomically
# ------------------------------------------------------------------------------------------------


def test_setup_refuses_to_overwrite_its_profile(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text('{"schema_version": 1}\n')
    assert main(["setup", "--profile", str(profile), "--out", str(profile)]) == 2
    message = one_line_error(capsys, "setup")
    assert "--out" in message and "--profile" in message and str(profile) in message
    assert profile.read_text() == '{"schema_version": 1}\n'
    # the same file under another spelling
    os.symlink(profile, tmp_path / "link.json")
    assert main(["setup", "--profile", str(profile), "--out", str(tmp_path / "link.json")]) == 2
    assert profile.read_text() == '{"schema_version": 1}\n'
    capsys.readouterr()


@pytest.mark.parametrize(
    "command, argv, module, attr",
    [
        (
            "bench",
            ["--random-weights", "qwen2.5-0.5b", "--device", "cpu"],
            flashrl.tools.bench,
            "run_bench",
        ),
        ("profile", ["--model", "m", "--device", "cpu"], flashrl.tools.profile, "run_profile"),
        ("setup", ["--profile", "p.json"], flashrl.tools.setup, "run_setup"),
        ("verify", ["--device", "cpu"], flashrl.tools.verify, "run_verify"),
    ],
)
def test_bad_out_paths_fail_before_the_work(
    command, argv, module, attr, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(module, attr, _fail_if_called)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_dir").mkdir()
    for out, expected in [
        (tmp_path / "a_dir", "is a directory"),
        (tmp_path / "missing" / "x.out", "does not exist"),
    ]:
        assert main([command, *argv, "--out", str(out)]) == 2
        message = one_line_error(capsys, command)
        assert message.startswith(f"--out {out}") and expected in message, message
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        if os.access(readonly, os.W_OK):
            return  # root: every directory is writable, nothing to refuse
        assert main([command, *argv, "--out", str(readonly / "x.out")]) == 2
        assert "not writable" in one_line_error(capsys, command)
    finally:
        readonly.chmod(0o700)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--batch", "0"),
        ("--output-len", "-1"),
        ("--prompt-len", "0"),
        ("--max-prefill-tokens", "0"),
        ("--threads", "0"),
    ],
)
def test_bench_sizes_are_checked(flag, value, monkeypatch, capsys):
    monkeypatch.setattr(flashrl.tools.bench, "_bench_engine", _fail_if_called)
    assert (
        main(
            [
                "bench",
                "--random-weights",
                "qwen2.5-0.5b",
                "--device",
                "cpu",
                "--out",
                "",
                flag,
                value,
            ]
        )
        == 2
    )
    assert one_line_error(capsys, "bench").startswith(f"{flag} {value}")


def test_bench_and_profile_refuse_out_equal_to_an_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(flashrl.tools.bench, "run_bench", _fail_if_called)
    monkeypatch.setattr(flashrl.tools.profile, "run_profile", _fail_if_called)
    config = tmp_path / "config.json"
    config.write_text("{}")
    assert main(["bench", "--random-weights", str(config), "--out", str(config)]) == 2
    assert "--random-weights" in one_line_error(capsys, "bench")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1+1=\n")
    assert (
        main(
            ["profile", "--model", str(tmp_path), "--prompts", str(prompts), "--out", str(prompts)]
        )
        == 2
    )
    assert "--prompts" in one_line_error(capsys, "profile")
    assert (config.read_text(), prompts.read_text()) == ("{}", "1+1=\n")


def minimal_profile(path):
    """The smallest file `flashrl setup` accepts: one scheme, no layers, no measured mismatch."""
    from flashrl.quant.linear import DEFAULT_SKIP
    from flashrl.tools.profile import SCHEMA_VERSION

    doc = {
        "schema_version": SCHEMA_VERSION,
        "layers": [],
        "settings": {
            "schemes": ["int8"],
            "kv_cache_dtype": "bf16",
            "lm_head_fp32": False,
            "threshold": 0.1,
        },
        "schemes": {
            "int8": {"skip": list(DEFAULT_SKIP), "mismatch": {}, "mismatch_after_skip": None}
        },
    }
    path.write_text(json.dumps(doc))
    return path


def test_outputs_are_written_atomically(tmp_path, monkeypatch, capsys):
    """A write that fails (here: a full disk at the rename) leaves the previous output intact and no
    temporary file behind, and is one line naming the file."""
    from flashrl import fileio
    from flashrl.core.config import RolloutConfig

    profile = minimal_profile(tmp_path / "p.json")
    out = tmp_path / "flashrl.yaml"
    out.write_text("previous\n")

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(fileio.os, "replace", full_disk)
    assert main(["setup", "--profile", str(profile), "--out", str(out)]) == 2
    assert one_line_error(capsys, "setup") == f"{out}: No space left on device"
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flashrl.yaml", "p.json"]
    monkeypatch.undo()
    assert main(["setup", "--profile", str(profile), "--out", str(out)]) == 0
    assert RolloutConfig.from_yaml(out).quant == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flashrl.yaml", "p.json"]


# ------------------------------------------------------------------------------------------------
# train --config: malformed YAML, unsafe tags, wrong types
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_training(monkeypatch):
    import flashrl.rl.run

    monkeypatch.setattr(flashrl.rl.run, "run", _fail_if_called)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("steps: [10\n", ["not valid YAML"]),
        ('run: {steps: "ten"}\n', ["steps='ten'", "an integer"]),
        ("algo: {lr: [1]}\n", ["lr=[1]", "a number"]),
        ("run: {steps: true}\n", ["steps=True", "an integer"]),
        ("run: {plot: 3}\n", ["plot=3", "true or false"]),
        ("algo: {lr: .nan}\n", ["lr=nan", "a number"]),
        ("model: [a, b]\n", ["model=['a', 'b']", "a string"]),
        ("- steps\n", ["expected a mapping of TrainConfig fields, got list"]),
        ("1: 2\n", ["unknown config key(s)", "1"]),
        ("\xff\xfe: 1\n", []),
    ],
)
def test_train_config_file_errors_name_file_field_value_and_type(
    text, expected, tmp_path, capsys, no_training
):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="latin-1" if "\xff" in text else "utf-8")
    assert main(["train", "--config", str(path)]) == 2
    message = one_line_error(capsys, "train")
    assert str(path) in message
    for part in expected:
        assert part in message, message


def test_train_config_python_tags_are_not_executed(tmp_path, capsys, no_training):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f'steps: !!python/object/apply:os.system ["touch {marker}"]\n')
    assert main(["train", "--config", str(path)]) == 2
    assert str(path) in one_line_error(capsys, "train")
    assert not marker.exists()


def test_train_config_directory_and_missing_file(tmp_path, capsys, no_training):
    assert main(["train", "--config", str(tmp_path)]) == 2
    assert "is a directory" in one_line_error(capsys, "train")
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in one_line_error(capsys, "train")


def test_train_overrides_name_the_flag(capsys, no_training):
    assert main(["train", "--run.steps", "ten"]) == 2
    assert "steps='ten' is not an integer" in one_line_error(capsys, "train")
    assert main(["train", "--algo.lr", "nan"]) == 2
    assert "lr='nan'" in one_line_error(capsys, "train")


def test_train_config_values_of_the_right_type_still_load(tmp_path):
    from flashrl.rl.config_build import build_config

    path = tmp_path / "ok.yaml"
    path.write_text(
        "run:\n  steps: 3\n  plot: false\nrollout:\n  backend: vllm\n  backend_kwargs: {enforce_eager: true}\n"
        "algo:\n  lr: 1\n"
        "correction:\n  rejection_thresholds: 0.01\n  rejection: seq_mean_k3\n"
    )
    config = build_config("tiny-cpu", str(path), {})
    assert (
        config.run.steps,
        config.algo.lr,
        config.run.plot,
        config.correction.rejection_thresholds,
    ) == (3, 1.0, False, (0.01,))
    assert isinstance(config.algo.lr, float) and json.loads(config.rollout.backend_kwargs) == {
        "enforce_eager": True
    }


# ------------------------------------------------------------------------------------------------
# generate: --prompt-ids, JSON output
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids", ["a,b", "1,,x", "1.5", "", " , "])
def test_prompt_ids_must_be_comma_separated_integers(ids, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(flashrl.engine, "Engine", _fail_if_called)
    assert main(["generate", "--model", str(tmp_path), "--device", "cpu", "--prompt-ids", ids]) == 2
    message = one_line_error(capsys, "generate")
    assert message.startswith(f"--prompt-ids {ids!r}") and "comma-separated integers" in message


class _FakeEngine:
    """An engine whose rollout has non-finite logprobs (a -inf from a token outside top-k / top-p)."""

    def __init__(self, *args, **kwargs):
        self.tokenizer, self.config = None, SimpleNamespace(quant="bf16")

    def generate(self, prompts, params):
        return [
            SimpleNamespace(
                prompt_index=0,
                sample_index=0,
                text="",
                response_ids=[5, 6, 7],
                logprobs=[-math.inf, math.nan, -0.5],
                finish_reason="length",
            )
        ]


def test_generate_json_is_valid_json_with_null_for_non_finite_logprobs(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(flashrl.engine, "Engine", _FakeEngine)
    assert (
        main(
            [
                "generate",
                "--model",
                str(tmp_path),
                "--device",
                "cpu",
                "--prompt-ids",
                "1,2",
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "NaN" not in out and "Infinity" not in out
    row = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert row["logprobs"] == [None, None, -0.5]
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "null" in capsys.readouterr().out  # documented


# ------------------------------------------------------------------------------------------------
# --device cuda without CUDA
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, argv",
    [
        ("verify", []),
        ("bench", ["--random-weights", "qwen2.5-0.5b", "--out", ""]),
        ("generate", ["--model", "m", "--prompt", "hi"]),
        ("profile", ["--model", "m"]),
        ("train", []),
    ],
)
def test_cuda_device_without_cuda_is_one_line(command, argv, monkeypatch, capsys, tmp_path):
    import torch

    import flashrl.rl.run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module, attr in [
        (flashrl.tools.verify, "run_verify"),
        (flashrl.tools.bench, "run_bench"),
        (flashrl.engine, "Engine"),
        (flashrl.tools.profile, "run_profile"),
        (flashrl.rl.run, "run"),
    ]:
        monkeypatch.setattr(module, attr, _fail_if_called)
    monkeypatch.chdir(tmp_path)
    device_flag = "--run.device" if command == "train" else "--device"
    assert main([command, *argv, device_flag, "cuda"]) == 2
    assert "CUDA is not available" in one_line_error(capsys, command)


def test_device_names_are_checked(capsys, monkeypatch):
    monkeypatch.setattr(flashrl.tools.verify, "run_verify", _fail_if_called)
    assert main(["verify", "--device", "gpu"]) == 2
    assert "--device 'gpu' is invalid" in one_line_error(capsys, "verify")


# ------------------------------------------------------------------------------------------------
# FLASHRL_* environment variables
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("FLASHRL_CONFIG", "int4"),
        ("FLASHRL_CONFIG", "missing.yaml"),
        ("FLASHRL_LMHEAD_FP32", "maybe"),
        ("FLASHRL_LOGGING_LEVEL", "loud"),
        ("FLASHRL_LOGGING_FILE", "/nonexistent/dir/x.log"),
        ("FLASHRL_QUANT_KERNELS", "cuda"),
    ],
)
def test_bad_environment_variables_are_config_errors(name, value, monkeypatch, capsys, tmp_path):
    from flashrl.core.env import configure_logging, from_env
    from flashrl.quant.kernels import get_mode

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        from_env()
        configure_logging()
        get_mode()
    monkeypatch.setattr(flashrl.tools.verify, "run_verify", _fail_if_called)
    assert main(["verify", "--device", "cpu"]) == 2
    assert name in one_line_error(capsys, "verify")
