"""No code runs from a model folder (issue 24): a folder whose ``config.json`` or
``tokenizer_config.json`` has an ``auto_map`` pointing at a ``.py`` file beside it is refused with one
`ConfigError` naming the entry and the file, before `transformers` sees it; the planted code, which
writes a marker file when imported, never runs and no "do you wish to run the custom code?" prompt
is shown. The commands run as subprocesses whose stdin holds ``y`` and then ends: a prompt would
read the ``y`` and run the code (the marker test fails) instead of hanging."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashrl
from flashrl.engine import Engine, EngineConfig
from flashrl.errors import CheckpointError, ConfigError
from flashrl.model.remote_code import check_no_custom_code
from flashrl.rl.config_build import build_config
from flashrl.rl.trainer import Trainer
from flashrl.testing import save_tiny_model
from shorthand import dotted

FLASHRL = Path(sys.executable).parent / "flashrl"
PROMPT = "Do you wish to run the custom code"
VARIANTS = ("custom_model_type", "builtin_model_type", "tokenizer")
"""config.json's auto_map with a model_type only the custom code knows; config.json's auto_map with
a model_type transformers knows (transformers would quietly use its own class); an auto_map in
tokenizer_config.json only."""


def _code(marker: Path) -> str:
    return (
        f"open({str(marker)!r}, 'w').write('custom code ran')\n"
        "from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM\n"
        "class EvilConfig(Qwen2Config):\n    model_type = 'evil'\n"
        "class EvilModel(Qwen2ForCausalLM):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )


def plant(source: Path, folder: Path, variant: str) -> tuple[Path, Path]:
    """A copy of the tiny model `source` in `folder` that asks for custom code (`variant`); the
    code writes the returned marker file when it is imported."""
    folder.mkdir(parents=True)
    for f in source.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    marker = folder.parent / f"{folder.name}.MARKER"
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (folder / f"{module}.py").write_text(_code(marker))
    name = "tokenizer_config.json" if variant == "tokenizer" else "config.json"
    raw = json.loads((folder / name).read_text())
    if variant == "tokenizer":
        raw["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        raw["tokenizer_class"] = "EvilTokenizer"
    else:
        raw["auto_map"] = {
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilModel",
        }
        raw["model_type"] = "evil" if variant == "custom_model_type" else "qwen2"
    (folder / name).write_text(json.dumps(raw))
    return folder, marker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen2", tokenizer=True)


@pytest.fixture(params=VARIANTS)
def planted(request, tiny, tmp_path) -> tuple[Path, Path, str]:
    folder, marker = plant(tiny, tmp_path / "evil", request.param)
    return folder, marker, request.param


def _env(tmp_path: Path) -> dict[str, str]:
    """Offline, and transformers' module cache in `tmp_path`: code that ran leaves nothing behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHRL_")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, input="y\n", capture_output=True, text=True, timeout=300, cwd=cwd, env=_env(cwd)
    )


def _expected_message(folder: Path, variant: str) -> tuple[str, str]:
    """(the file, the code file) the error must name."""
    if variant == "tokenizer":
        return str(folder / "tokenizer_config.json"), str(folder / "tokenization_evil.py")
    return str(folder / "config.json"), str(folder / "configuration_evil.py")


def test_the_planted_code_runs_when_trusted(tiny, tmp_path):
    """Control: the plant is live (transformers runs it with trust_remote_code=True)."""
    for variant in ("custom_model_type", "tokenizer"):
        folder, marker = plant(tiny, tmp_path / variant, variant)
        auto = "AutoTokenizer" if variant == "tokenizer" else "AutoConfig"
        code = f"import transformers; transformers.{auto}.from_pretrained({str(folder)!r}, trust_remote_code=True)"
        _run([sys.executable, "-c", code], tmp_path)
        assert marker.is_file(), variant


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--run.steps", "1", "--run.device", "cpu", "--run.output-dir", "{out}/run"],
        ["profile", "--device", "cpu", "--out", "{out}/profile.json"],
        ["bench", "--device", "cpu", "--out", "{out}/bench.json"],
        ["generate", "--device", "cpu", "--prompt", "hi"],
    ],
    ids=lambda c: c[0],
)
def test_commands_refuse_a_folder_that_asks_for_code(command, planted, tmp_path):
    folder, marker, variant = planted
    out = tmp_path / "out"
    out.mkdir()
    args = [a.replace("{out}", str(out)) for a in command]
    result = _run([str(FLASHRL), args[0], "--model", str(folder), *args[1:]], tmp_path)
    assert not marker.exists(), "the model folder's code ran"
    assert result.returncode == 2, result.stderr
    assert PROMPT not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flashrl {args[0]}: error: "), result.stderr
    for name in (*_expected_message(folder, variant), "auto_map", "trust_remote_code=False"):
        assert name in lines[0]
    assert list(out.iterdir()) == []  # nothing written (not even the train run directory)


def test_engine_and_trainer_refuse_a_folder_that_asks_for_code(planted, tmp_path):
    folder, marker, variant = planted
    for make in (
        lambda: Engine(folder, engine_config=EngineConfig(device="cpu")),
        lambda: Trainer(
            build_config(
                "tiny-cpu",
                None,
                {"model": str(folder), "run.output_dir": str(tmp_path / "run"), "run.plot": False},
            )
        ),
    ):
        with pytest.raises(ConfigError) as info:
            make()
        for name in (*_expected_message(folder, variant), "auto_map"):
            assert name in str(info.value)
    assert not marker.exists()
    assert not (tmp_path / "run").exists()


def test_check_names_the_entry_and_where_its_code_lives(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"auto_map": {"AutoModel": "org/repo--modeling_x.Model"}})
    )
    with pytest.raises(
        ConfigError, match=r"'AutoModel'.*modeling_x.py of the Hub repository org/repo"
    ):
        check_no_custom_code(tmp_path)
    for harmless in ({}, {"auto_map": {}}, {"auto_map": None}):  # nothing asks for code
        (tmp_path / "config.json").write_text(json.dumps(harmless))
        check_no_custom_code(tmp_path)
    check_no_custom_code(tmp_path / "missing")  # the loader reports a missing folder


def test_trust_remote_code_cannot_be_switched_on():
    vllm = {"rollout.backend": "vllm"}
    kwargs = "rollout.backend_kwargs"
    with pytest.raises(ConfigError, match=f"{kwargs}: trust_remote_code=True is not allowed"):
        build_config("tiny-cpu", None, {**vllm, kwargs: '{"trust_remote_code": true}'})
    build_config("tiny-cpu", None, {**vllm, kwargs: '{"trust_remote_code": false}'})


def _no_remote_code(call: ast.Call, assigned: dict[str, ast.expr]) -> bool:
    """Whether a loader call passes ``trust_remote_code=False``: literally, as ``**NO_REMOTE_CODE``
    or as ``**kwargs`` where ``kwargs = dict(..., trust_remote_code=False)`` or a dict display that
    ends in it."""
    for kw in call.keywords:
        if kw.arg == "trust_remote_code":
            return isinstance(kw.value, ast.Constant) and kw.value.value is False
        if kw.arg is None and isinstance(kw.value, ast.Name):
            if kw.value.id == "NO_REMOTE_CODE":
                return True
            spread = assigned.get(kw.value.id)
            if isinstance(spread, ast.Call) and _no_remote_code(spread, {}):
                return True
            if isinstance(spread, ast.Dict) and _last_entry_says_false(spread):
                return True
    return False


def _last_entry_says_false(d: ast.Dict) -> bool:
    """A dict display ending in ``**NO_REMOTE_CODE`` or ``"trust_remote_code": False`` (the last
    entry wins over any user-given one spread before it)."""
    key, value = d.keys[-1], d.values[-1]
    if key is None:
        return isinstance(value, ast.Name) and value.id == "NO_REMOTE_CODE"
    return (
        isinstance(key, ast.Constant)
        and key.value == "trust_remote_code"
        and isinstance(value, ast.Constant)
        and value.value is False
    )


def test_every_loader_call_passes_trust_remote_code_false():
    """Every ``from_pretrained`` and ``LLM(...)`` call in flashrl's source says
    ``trust_remote_code=False`` explicitly, so no transformers default can prompt or run code."""
    src, calls, missing = Path(flashrl.__file__).parent, 0, []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        assigned = {
            t.id: node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("from_pretrained", "LLM"):
                calls += 1
                if not _no_remote_code(node, assigned):
                    missing.append(f"{path.relative_to(src)}:{node.lineno}")
    assert calls >= 8 and not missing, missing


def test_bench_random_weights_config_that_asks_for_code(tmp_path, capsys, flashrl_logger):
    from flashrl.tools.cli import main

    config = tmp_path / "evil.json"
    config.write_text(
        json.dumps({"vocab_size": 256, "auto_map": {"AutoConfig": "configuration_evil.C"}})
    )
    argv = ["bench", "--random-weights", str(config), "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "bench.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flashrl bench: error: --random-weights {config}: auto_map entry")
    assert len(err.splitlines()) == 1 and not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("manifest", [True, False])
def test_resume_refuses_a_checkpoint_that_asks_for_code(tiny, tmp_path, manifest):
    """A checkpoint of the run given an auto_map afterwards: the resume is refused, nothing runs
    and the run directory is unchanged. With its manifest the edited config.json is found as
    damage first; without one (an older checkpoint, or an attacker who removed it) the auto_map
    check refuses it."""

    def config(**extra):
        values = dict(
            model=str(tiny), output_dir=str(tmp_path / "run"), steps=1, batch_size=4,
            group_size=2, micro_batch_size=4, max_response_tokens=2, task_max_operand=9,
            plot=False, device="cpu", dtype="fp32", reward="exact_match",
        )  # fmt: skip
        values.update(extra)
        return build_config("tiny-cpu", None, dotted(values))

    Trainer(config()).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    _, marker = plant(tiny, tmp_path / "evil", "custom_model_type")
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (checkpoint / "config.json").write_text(json.dumps(raw))
    (checkpoint / "modeling_evil.py").write_text(
        (tmp_path / "evil" / "modeling_evil.py").read_text()
    )
    if not manifest:
        (checkpoint / "manifest.json").unlink()
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    error, message = (
        (CheckpointError, f"{checkpoint / 'config.json'}: .* manifest.json recorded")
        if manifest
        else (ConfigError, f"{checkpoint / 'config.json'}: auto_map entry")
    )
    with pytest.raises(error, match=message):
        Trainer(config(steps=2, resume="latest"))
    assert not marker.exists()
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
