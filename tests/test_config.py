"""RolloutConfig, YAML files and the FLASHRL_* environment variables: every value, every error."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from flashrl.core.config import SCHEME_NAMES, RolloutConfig, resolve_config
from flashrl.core.env import ENV_VARS, configure_logging, from_env, parse_bool
from flashrl.errors import ConfigError
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.quant.schemes import SCHEMES

ALLOWED_SCHEMES = "allowed: bf16, int8, fp8, fp8_channel, fp8_block, int8_g128, int8_g64 or a path to a .yaml file"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------------------------------
# RolloutConfig
# ------------------------------------------------------------------------------------------------


def test_defaults():
    c = RolloutConfig()
    assert (c.quant, c.skip, c.kv_cache_dtype, c.kv_scale, c.lm_head_fp32, c.logprobs_mode) == (
        "bf16",
        DEFAULT_SKIP,
        "bf16",
        "calibrated",
        False,
        "processed",
    )


def test_core_vocabulary_is_the_quantization_packages():
    """flashrl.core names the schemes without importing flashrl.quant: the names must agree, and a
    QuantScheme or any case is accepted as before."""
    assert SCHEME_NAMES == tuple(SCHEMES)
    assert RolloutConfig(quant=SCHEMES["fp8_block"]).quant == "fp8_block"
    assert RolloutConfig(quant=" INT8 ").quant == "int8"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(quant="int4"),
            "unknown quantization scheme 'int4'; allowed: bf16, int8, fp8, fp8_channel, fp8_block",
        ),
        (dict(quant=None), "unknown quantization scheme None"),
        (dict(skip=None), "skip must be a list of module-name patterns, got None"),
        (dict(skip="lm_head"), "skip must be a list of module-name patterns, got 'lm_head'"),
        (dict(skip=("lm_head", "")), "non-empty module-name patterns, got ''"),
        (dict(skip=("lm_head", 3)), "non-empty module-name patterns, got 3"),
        (dict(skip=("re:(",)), "skip pattern 're:(' is not a valid regular expression"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is invalid; allowed: bf16, fp8"),
        (
            dict(kv_scale="static"),
            "kv_scale='static' is invalid; allowed: calibrated, dynamic or a positive finite number",
        ),
        (dict(kv_scale=0.0), "kv_scale=0.0 is invalid"),
        (dict(kv_scale=-1), "kv_scale=-1 is invalid"),
        (dict(kv_scale=float("nan")), "kv_scale=nan is invalid"),
        (dict(kv_scale=float("inf")), "kv_scale=inf is invalid"),
        (dict(kv_scale=True), "kv_scale=True is invalid"),
        (dict(lm_head_fp32="yes"), "lm_head_fp32 must be true or false, got 'yes'"),
        (
            dict(logprobs_mode="sampled"),
            "logprobs_mode='sampled' is invalid; allowed: processed, raw",
        ),
    ],
)
def test_invalid_fields_name_field_and_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RolloutConfig(**kwargs)


def test_normalization():
    assert RolloutConfig(quant=" INT8 ").quant == "int8"
    assert RolloutConfig(skip=["lm_head", "*.down_proj"]).skip == ("lm_head", "*.down_proj")
    fp8 = {"kv_cache_dtype": "fp8"}
    assert RolloutConfig(kv_scale="0.5", **fp8).kv_scale == 0.5
    assert RolloutConfig(kv_scale=2, **fp8).kv_scale == 2.0
    assert RolloutConfig(kv_scale="dynamic", **fp8).kv_scale == "dynamic"


@pytest.mark.parametrize("kv_scale", ["dynamic", 0.5])
def test_a_kv_scale_needs_an_fp8_cache(kv_scale):
    """One rule for every engine (built-in, vLLM, FLASHRL_CONFIG, flashrl train): a kv_scale other
    than the default on a cache that is not fp8 would do nothing, so it is refused."""
    from flashrl.rl.config_build import build_config

    with pytest.raises(
        ConfigError, match=f"^kv_scale={kv_scale!r} applies to kv_cache_dtype='fp8'"
    ):
        RolloutConfig(kv_scale=kv_scale)
    with pytest.raises(ConfigError, match="^rollout: kv_scale=.*set kv_cache_dtype to fp8"):
        build_config("tiny-cpu", None, {"rollout.kv_scale": kv_scale})
    assert RolloutConfig(kv_scale="calibrated").kv_cache_dtype == "bf16"


def test_from_dict_unknown_key_names_source_and_allowed():
    with pytest.raises(
        ValueError,
        match=r"my.yaml: unknown key\(s\) quantization; allowed: quant, skip, kv_cache_dtype",
    ):
        RolloutConfig.from_dict({"quantization": "int8"}, source="my.yaml")
    with pytest.raises(ValueError, match="my.yaml: kv_cache_dtype='fp4' is invalid"):
        RolloutConfig.from_dict({"kv_cache_dtype": "fp4"}, source="my.yaml")
    with pytest.raises(ValueError, match="expected a mapping"):
        RolloutConfig.from_dict(["int8"], source="my.yaml")


# ------------------------------------------------------------------------------------------------
# YAML
# ------------------------------------------------------------------------------------------------


def test_yaml_round_trip_with_header(tmp_path):
    config = RolloutConfig(
        quant="fp8_channel",
        skip=("lm_head", "model.layers.1.mlp.down_proj", "re:layers\\.0\\."),
        kv_cache_dtype="fp8",
        kv_scale=0.25,
        lm_head_fp32=True,
        logprobs_mode="raw",
    )
    path = config.to_yaml(tmp_path / "flashrl.yaml", header="written by a test\n\nsecond line")
    text = path.read_text()
    assert text.startswith("# written by a test\n#\n# second line\nquant: fp8_channel\n")
    assert RolloutConfig.from_yaml(path) == config
    assert resolve_config(str(path)) == config


def test_yaml_nested_rollout_key_and_empty_file(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("rollout:\n  quant: int8\n  skip: [lm_head, '*.down_proj']\n")
    assert RolloutConfig.from_yaml(nested) == RolloutConfig(
        quant="int8", skip=("lm_head", "*.down_proj")
    )
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert RolloutConfig.from_yaml(empty) == RolloutConfig()


@pytest.mark.parametrize(
    "text, message",
    [
        ("quant: [int8\n", "not valid YAML"),
        ("- int8\n", "expected a mapping of config keys, got list"),
        ("quant: int8\nbogus: 1\n", r"unknown key\(s\) bogus"),
        ("rollout:\n  quant: int8\nsteps: 3\n", "keys steps next to 'rollout:'"),
        ("rollout: [int8]\n", "expected a mapping of config keys, got list"),
        ("quant: int4\n", "unknown quantization scheme 'int4'"),
        ("skip: lm_head\n", "skip must be a list"),
        ("skip:\n", "skip must be a list of module-name patterns, got None"),
    ],
)
def test_bad_yaml_files_name_the_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        RolloutConfig.from_yaml(path)
    assert "bad.yaml" in str(err.value)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RolloutConfig.from_yaml(tmp_path / "nope.yaml")


# ------------------------------------------------------------------------------------------------
# resolve_config
# ------------------------------------------------------------------------------------------------


def test_resolve_config_values(tmp_path):
    assert resolve_config(None) == RolloutConfig()
    config = RolloutConfig(quant="int8")
    assert resolve_config(config) is config
    for name in SCHEMES:
        assert resolve_config(name).quant == name
        assert resolve_config(name.upper()).quant == name
    no_suffix = tmp_path / "rollout_config"
    RolloutConfig(quant="fp8").to_yaml(no_suffix)
    assert resolve_config(str(no_suffix)).quant == "fp8"  # an existing file needs no .yaml suffix
    yml = RolloutConfig(quant="fp8_block").to_yaml(tmp_path / "c.YML")
    assert resolve_config(yml).quant == "fp8_block"  # Path objects and upper-case suffixes


def test_resolve_config_errors(tmp_path):
    with pytest.raises(ValueError, match=f"quant='int4' is invalid; {ALLOWED_SCHEMES}"):
        resolve_config("int4", source="quant")
    with pytest.raises(ValueError, match="config='' is invalid"):
        resolve_config("")
    with pytest.raises(FileNotFoundError, match="quant: config file 'missing.yaml' does not exist"):
        resolve_config("missing.yaml", source="quant")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_config(str(tmp_path / "dir" / "config"))


# ------------------------------------------------------------------------------------------------
# FLASHRL_CONFIG / FLASHRL_LMHEAD_FP32
# ------------------------------------------------------------------------------------------------


def test_from_env_unset_or_empty_is_none(monkeypatch):
    assert from_env({}) is None
    assert from_env({"FLASHRL_CONFIG": "", "FLASHRL_LMHEAD_FP32": "  "}) is None
    assert from_env() is None  # reads os.environ (cleared by the fixture)
    monkeypatch.setenv("FLASHRL_CONFIG", "fp8")
    assert from_env().quant == "fp8"  # and picks up os.environ


@pytest.mark.parametrize("name", list(SCHEMES))
def test_flashrl_config_schemes(name):
    config = from_env({"FLASHRL_CONFIG": name})
    assert config == RolloutConfig(quant=name)
    assert from_env({"FLASHRL_CONFIG": f" {name.upper()} "}) == config


def test_flashrl_config_yaml_path(tmp_path, monkeypatch):
    path = RolloutConfig(
        quant="int8", skip=("lm_head", "*.down_proj"), kv_cache_dtype="fp8"
    ).to_yaml(tmp_path / "flashrl.yaml")
    assert from_env({"FLASHRL_CONFIG": str(path)}) == RolloutConfig.from_yaml(path)
    monkeypatch.chdir(tmp_path)
    assert from_env({"FLASHRL_CONFIG": "flashrl.yaml"}).skip == (
        "lm_head",
        "*.down_proj",
    )  # relative path


@pytest.mark.parametrize("value", ["int4", "w8a8", "fp8-block", "bf 16"])
def test_flashrl_config_invalid_names_variable_and_allowed(value):
    with pytest.raises(ValueError, match=f"FLASHRL_CONFIG={value!r} is invalid; {ALLOWED_SCHEMES}"):
        from_env({"FLASHRL_CONFIG": value})


def test_flashrl_config_missing_or_bad_file(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="FLASHRL_CONFIG: config file 'nope.yaml' does not exist"
    ):
        from_env({"FLASHRL_CONFIG": "nope.yaml"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("quant: int8\nkv_cache_dtype: fp4\n")
    with pytest.raises(
        ValueError,
        match=r"FLASHRL_CONFIG='.*bad.yaml': .*bad.yaml: kv_cache_dtype='fp4' is invalid; allowed: bf16, fp8",
    ):
        from_env({"FLASHRL_CONFIG": str(bad)})


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " True "])
def test_lmhead_fp32_true(value):
    assert from_env({"FLASHRL_LMHEAD_FP32": value}) == RolloutConfig(lm_head_fp32=True)
    assert from_env({"FLASHRL_CONFIG": "int8", "FLASHRL_LMHEAD_FP32": value}) == RolloutConfig(
        quant="int8", lm_head_fp32=True
    )


@pytest.mark.parametrize("value", ["0", "false", "No", "off"])
def test_lmhead_fp32_false_overrides_the_file(tmp_path, value):
    path = RolloutConfig(quant="int8", lm_head_fp32=True).to_yaml(tmp_path / "c.yaml")
    assert from_env({"FLASHRL_CONFIG": str(path)}).lm_head_fp32 is True
    assert from_env({"FLASHRL_CONFIG": str(path), "FLASHRL_LMHEAD_FP32": value}) == RolloutConfig(
        quant="int8"
    )


@pytest.mark.parametrize("value", ["2", "maybe", "enabled", "fp32"])
def test_lmhead_fp32_invalid(value):
    with pytest.raises(
        ValueError,
        match=f"FLASHRL_LMHEAD_FP32={value!r} is invalid; allowed: 1/true/yes/on or 0/false/no/off",
    ):
        from_env({"FLASHRL_LMHEAD_FP32": value})
    with pytest.raises(ValueError, match="X='2' is invalid"):
        parse_bool("X", "2")


def test_engine_applies_environment(tiny_models, monkeypatch):
    from flashrl.engine import Engine, EngineConfig
    from flashrl.quant.linear import DenseLinear, QuantLinear

    model = tiny_models("qwen2")
    monkeypatch.setenv("FLASHRL_CONFIG", "int8")
    monkeypatch.setenv("FLASHRL_LMHEAD_FP32", "1")
    cpu = EngineConfig(device="cpu", progress=False, max_len=16)
    engine = Engine(
        model, engine_config=EngineConfig(device="cpu", progress=False, max_batch=1, max_len=16)
    )
    assert engine.config == RolloutConfig(quant="int8", lm_head_fp32=True)
    assert isinstance(engine.model.layers[0].mlp.down_proj, QuantLinear)
    assert (
        isinstance(engine.model.lm_head, DenseLinear)
        and engine.model.lm_head.weight.dtype == torch.float32
    )
    monkeypatch.setenv("FLASHRL_CONFIG", "int4")
    with pytest.raises(ValueError, match="FLASHRL_CONFIG='int4' is invalid"):
        Engine(model, engine_config=EngineConfig(device="cpu", progress=False))
    assert Engine(model, rollout_config="bf16", engine_config=cpu).config.quant == "bf16"
    assert Engine(model, "bf16", cpu).config.quant == "bf16"  # explicit wins


def test_engine_refuses_keywords_naming_their_config(tiny_models):
    """`Engine` takes its settings in its two configs only: a field as a keyword is refused before
    anything loads, naming the config it goes in (``quant=``, the old name of `rollout_config`,
    too), and an unknown name lists the fields of both configs; an `EngineConfig` in the rollout
    config's place is named as such."""
    from flashrl.engine import Engine, EngineConfig

    model = tiny_models("qwen2")
    with pytest.raises(ConfigError, match="max_batch"):
        Engine(model / "missing", max_batch=8)  # before the checkpoint is read
    got = "Engine got keyword argument(s)"
    exact = {
        f"{got} device; pass them in a config: EngineConfig(device=...) as engine_config": dict(
            device="cpu"
        ),
        f"{got} kv_cache_dtype; pass them in a config: a RolloutConfig(kv_cache_dtype=...) as "
        "rollout_config": dict(kv_cache_dtype="fp8"),
        f"{got} max_batch, kv_cache_dtype; pass them in a config: EngineConfig(max_batch=...) as "
        "engine_config, a RolloutConfig(kv_cache_dtype=...) as rollout_config": dict(
            max_batch=8, kv_cache_dtype="fp8"
        ),
        f"{got} quant, progress; pass them in a config: EngineConfig(progress=...) as "
        "engine_config, a RolloutConfig(quant=...) as rollout_config (or the scheme alone: "
        "Engine(model, 'int8'))": dict(quant="int8", progress=False),
    }
    for message, kwargs in exact.items():
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            Engine(model, **kwargs)
    with pytest.raises(ConfigError, match=re.escape("RolloutConfig(quant=...) as rollout_config")):
        Engine(model, "int8", quant="int8")
    unknown = (
        f"{got} quantization; quantization: no such setting (Engine takes model_dir, "
        "rollout_config, engine_config; EngineConfig fields: device, dtype, max_batch"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(unknown)}.*RolloutConfig fields: quant, "):
        Engine(model, quantization="int8")
    with pytest.raises(ConfigError, match=r"as engine_config; foo: no such setting \(Engine takes"):
        Engine(model, max_len=16, foo=1)
    with pytest.raises(
        ConfigError, match="^engine_config must be an EngineConfig or None, got dict"
    ):
        Engine(model, "int8", {"max_batch": 8})
    wrong_order = "rollout_config must be a scheme name, a YAML path or a RolloutConfig, got a "
    with pytest.raises(ConfigError, match=f"^{wrong_order}EngineConfig .an engine's EngineConfig"):
        Engine(model, EngineConfig(max_batch=8))
    with pytest.raises(ConfigError, match=f"^{wrong_order}int$"):
        Engine(model, 8)


# ------------------------------------------------------------------------------------------------
# FLASHRL_LOGGING_LEVEL / FLASHRL_LOGGING_FILE
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, level",
    [
        ("DEBUG", logging.DEBUG),
        ("info", logging.INFO),
        (" Warning ", logging.WARNING),
        ("ERROR", logging.ERROR),
        ("critical", logging.CRITICAL),
    ],
)
def test_logging_level(flashrl_logger, value, level):
    assert configure_logging({"FLASHRL_LOGGING_LEVEL": value}) is flashrl_logger
    assert flashrl_logger.level == level


@pytest.mark.parametrize("value", ["verbose", "10", "warn "])
def test_logging_level_invalid(flashrl_logger, value):
    before = flashrl_logger.level
    with pytest.raises(
        ValueError,
        match=f"FLASHRL_LOGGING_LEVEL={value!r} is invalid; allowed: DEBUG, INFO, WARNING, ERROR, CRITICAL",
    ):
        configure_logging(
            {"FLASHRL_LOGGING_LEVEL": value, "FLASHRL_LOGGING_FILE": "/tmp/never-opened.log"}
        )
    assert flashrl_logger.level == before  # nothing changed, not even the file handler
    assert not any(isinstance(h, logging.FileHandler) for h in flashrl_logger.handlers)


def test_logging_file_receives_flashrl_records_only(flashrl_logger, tmp_path):
    path = tmp_path / "flashrl.log"
    configure_logging({"FLASHRL_LOGGING_LEVEL": "INFO", "FLASHRL_LOGGING_FILE": str(path)})
    configure_logging(
        {"FLASHRL_LOGGING_LEVEL": "INFO", "FLASHRL_LOGGING_FILE": str(path)}
    )  # idempotent
    assert sum(isinstance(h, logging.FileHandler) for h in flashrl_logger.handlers) == 1
    logging.getLogger("flashrl.engine.engine").info("hello from the engine")
    logging.getLogger("flashrl").debug("below the level")
    logging.getLogger("other_library").warning("not ours")
    for handler in flashrl_logger.handlers:
        handler.flush()
    text = path.read_text()
    assert "INFO flashrl.engine.engine: hello from the engine" in text
    assert "below the level" not in text and "not ours" not in text


def test_logging_file_replaced_and_removed(flashrl_logger, tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    configure_logging({"FLASHRL_LOGGING_FILE": str(first)})
    configure_logging({"FLASHRL_LOGGING_FILE": str(second)})
    files = [h.baseFilename for h in flashrl_logger.handlers if isinstance(h, logging.FileHandler)]
    assert files == [str(second)]
    flashrl_logger.warning("to b")
    configure_logging({})
    assert not any(isinstance(h, logging.FileHandler) for h in flashrl_logger.handlers)
    flashrl_logger.warning("to nobody's file")
    assert "to b" in second.read_text() and "nobody" not in second.read_text()
    assert not first.exists() or "to b" not in first.read_text()


def test_logging_file_errors(flashrl_logger, tmp_path):
    with pytest.raises(ValueError, match="FLASHRL_LOGGING_FILE=.*directory .* does not exist"):
        configure_logging({"FLASHRL_LOGGING_FILE": str(tmp_path / "missing" / "x.log")})
    with pytest.raises(ValueError, match="FLASHRL_LOGGING_FILE=.* is a directory"):
        configure_logging({"FLASHRL_LOGGING_FILE": str(tmp_path)})


def test_logging_level_adds_a_stderr_handler_only_when_nothing_would_show_records(
    flashrl_logger, capsys
):
    flashrl_logger.handlers[:] = []
    flashrl_logger.propagate = False  # no ancestor handlers either: records would go nowhere
    configure_logging({"FLASHRL_LOGGING_LEVEL": "INFO"})
    configure_logging({"FLASHRL_LOGGING_LEVEL": "INFO"})
    assert len(flashrl_logger.handlers) == 1
    flashrl_logger.info("visible")
    assert "INFO flashrl: visible" in capsys.readouterr().err
    flashrl_logger.handlers[:] = [
        logging.NullHandler()
    ]  # the application has its own handler: none added
    configure_logging({"FLASHRL_LOGGING_LEVEL": "DEBUG"})
    assert len(flashrl_logger.handlers) == 1


def test_import_configures_nothing_and_never_fails_on_bad_values():
    """Importing flashrl (and its engine) with bad FLASHRL_* values neither raises nor adds handlers."""
    env = dict(
        os.environ,
        FLASHRL_LOGGING_LEVEL="bogus",
        FLASHRL_LOGGING_FILE="/nonexistent/dir/x.log",
        FLASHRL_CONFIG="int4",
    )
    code = (
        "import logging, flashrl, flashrl.core.config, flashrl.engine.engine, flashrl.cli\n"
        "print(len(logging.getLogger('flashrl').handlers), len(logging.getLogger().handlers), "
        "logging.getLogger('flashrl').level)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0", "0"]


def test_cli_reports_bad_variables(flashrl_logger, monkeypatch, capsys, tmp_path):
    from flashrl.tools.cli import main

    monkeypatch.setenv("FLASHRL_LOGGING_LEVEL", "loud")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert (
        "FLASHRL_LOGGING_LEVEL='loud' is invalid; allowed: DEBUG, INFO, WARNING, ERROR, CRITICAL"
        in err
    )


@pytest.mark.parametrize("scheme", ["int8_g128", "int8_g64"])
def test_vllm_backend_names_group_int8(scheme):
    """The per-group int8 schemes have their own vLLM quantization method; online smoothing (the
    other low-mismatch lever) goes to it in the quantization config."""
    from flashrl.vllm_backend.config import engine_kwargs
    from flashrl.vllm_backend.names import METHOD_NAMES

    assert engine_kwargs(RolloutConfig(quant=scheme))["quantization"] == f"flashrl_{scheme}"
    assert "hf_overrides" not in engine_kwargs(RolloutConfig(quant=scheme))  # defaults: none
    assert METHOD_NAMES[scheme] == f"flashrl_{scheme}"
    kwargs = engine_kwargs(RolloutConfig(quant=scheme, smooth=0.5))
    assert kwargs["quantization"] == f"flashrl_{scheme}"
    assert kwargs["hf_overrides"]["quantization_config"] == {
        "quant_method": f"flashrl_{scheme}",
        "skip": list(DEFAULT_SKIP),
        "smooth": 0.5,
    }


def test_flashrl_config_file_with_smooth_reaches_the_vllm_engine(tmp_path, monkeypatch):
    """``FLASHRL_CONFIG=<yaml with smooth>``: `engine_kwargs()` (what the plugin's hook applies to
    an unmodified ``LLM(model)``) carries the exponent; bf16 with smooth is still refused, naming it."""
    from flashrl.vllm_backend.config import engine_kwargs

    path = tmp_path / "flashrl.yaml"
    path.write_text("quant: int8\nsmooth: 0.5\nskip: [lm_head, '*.mlp.gate', '*.down_proj']\n")
    monkeypatch.setenv("FLASHRL_CONFIG", str(path))
    monkeypatch.delenv("FLASHRL_LMHEAD_FP32", raising=False)
    quant_config = engine_kwargs()["hf_overrides"]["quantization_config"]
    assert quant_config["smooth"] == 0.5 and "*.down_proj" in quant_config["skip"]
    path.write_text("quant: bf16\nsmooth: 0.5\n")
    with pytest.raises(ConfigError, match="smooth needs a quantized scheme"):
        engine_kwargs()
