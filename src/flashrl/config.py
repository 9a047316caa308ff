"""Rollout configuration: one dataclass, YAML files, and the FLASHRL_* environment variables.

| variable                | values                                                   | effect                                  |
|-------------------------|----------------------------------------------------------|-----------------------------------------|
| `FLASHRL_CONFIG`        | `bf16`, `int8`, `fp8`, `fp8_channel`, `fp8_block`, or a path to a YAML file | the rollout config (scheme shorthand, or a file from `flashrl setup`) |
| `FLASHRL_LMHEAD_FP32`   | `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`          | lm head and logits in fp32 end to end; overrides the file's `lm_head_fp32` |
| `FLASHRL_LOGGING_LEVEL` | `DEBUG`, `INFO`, `WARNING`, `ERROR`, `CRITICAL` (any case)| level of the `flashrl` logger           |
| `FLASHRL_LOGGING_FILE`  | a file path (its directory must exist)                   | also write the `flashrl` logger's records to it (appended) |

An unset or empty variable is ignored. A bad value raises `ConfigError` (`ConfigFileNotFoundError`,
also a FileNotFoundError, for a missing file) naming the variable and the allowed values.
`from_env()` reads the first two and returns the resolved `RolloutConfig` (None when neither is
set); `configure_logging()` applies the last two. The `flashrl` command calls `configure_logging()` on start; a library user calls it
once, explicitly: importing flashrl configures nothing, so a bad value never breaks an import.

The library logs under the `flashrl` logger only and never configures the root logger: the
variables set the `flashrl` logger's level and add handlers to it (records still propagate to the
application's handlers as usual).
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from flashrl.errors import ConfigError
from flashrl.fileio import atomic_write_text
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.quant.schemes import SCHEMES, get_scheme

KV_CACHE_DTYPES = ("bf16", "fp8")
KV_SCALE_MODES = ("calibrated", "dynamic")
LOGPROB_MODES = ("processed", "raw")
LOGGING_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENV_VARS = ("FLASHRL_CONFIG", "FLASHRL_LMHEAD_FP32", "FLASHRL_LOGGING_LEVEL", "FLASHRL_LOGGING_FILE")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_YAML_SUFFIXES = (".yaml", ".yml")
LOGGER_NAME = "flashrl"


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A config file named by an option or variable does not exist (also a FileNotFoundError, as before)."""


def read_yaml(path: str | Path) -> Any:
    """The content of a YAML file, parsed with `yaml.safe_load` (tags that build Python objects are
    refused, never run). Every error is a one-line `ConfigError` naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; expected a YAML file")
    if not path.is_file():
        raise ConfigFileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not valid YAML (not UTF-8 text: byte {err.start})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(err)})") from None


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error as one line: where and what (PyYAML's own text spans several lines)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if problem is None:
        return " ".join(str(err).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(err, "context", None)
    return where + " ".join((f"{problem}" + (f" ({context})" if context else "")).split())


@dataclass(frozen=True)
class RolloutConfig:
    """How the rollout policy is quantized and how logprobs are returned."""

    quant: str = "bf16"
    """Weight scheme: one of `flashrl.quant.SCHEMES`."""
    skip: tuple[str, ...] = DEFAULT_SKIP
    """Linear layers kept in high precision (globs over module names, or ``re:`` regexes)."""
    kv_cache_dtype: str = "bf16"
    kv_scale: str | float = "calibrated"
    """FP8 KV scales: recalibrated after every weight update, computed per step, or a fixed float."""
    lm_head_fp32: bool = False
    logprobs_mode: str = "processed"

    def __post_init__(self) -> None:
        object.__setattr__(self, "quant", get_scheme(self.quant).name)
        object.__setattr__(self, "skip", _check_skip(self.skip))
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("logprobs_mode", self.logprobs_mode, LOGPROB_MODES)
        object.__setattr__(self, "kv_scale", _check_kv_scale(self.kv_scale))
        if not isinstance(self.lm_head_fp32, bool):
            raise ConfigError(f"lm_head_fp32 must be true or false, got {self.lm_head_fp32!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> "RolloutConfig":
        """Build from a mapping of field values; unknown keys raise, naming `source` and the allowed keys."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: expected a mapping of config keys, got {type(values).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed), key=str)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(allowed)}")
        try:
            return cls(**{k: tuple(v) if k == "skip" and isinstance(v, list) else v for k, v in values.items()})
        except ConfigError as err:
            if source == "config":
                raise
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RolloutConfig":
        """Read a YAML file of config keys (top level, or under a ``rollout:`` key)."""
        path = Path(path)
        data = read_yaml(path)
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
        if "rollout" in data:
            if set(data) != {"rollout"}:
                extra = ", ".join(sorted(map(str, set(data) - {"rollout"})))
                raise ConfigError(f"{path}: keys {extra} next to 'rollout:'; put every config key under 'rollout:'")
            return cls.from_dict(data["rollout"] or {}, source=f"{path} (rollout)")
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["skip"] = list(self.skip)
        return values

    def to_yaml(self, path: str | Path, header: str = "") -> Path:
        """Write the config as YAML, preceded by `header` as ``#`` comment lines; `from_yaml` reads it back."""
        text = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + yaml.safe_dump(
            self.to_dict(), sort_keys=False)
        return atomic_write_text(path, text)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name}={value!r} is invalid; allowed: {', '.join(allowed)}")


def _check_skip(skip: Any) -> tuple[str, ...]:
    if isinstance(skip, str) or not isinstance(skip, (list, tuple)):
        raise ConfigError(f"skip must be a list of module-name patterns, got {skip!r}")
    for pattern in skip:
        if not isinstance(pattern, str) or not pattern.strip():
            raise ConfigError(f"skip must be a list of non-empty module-name patterns, got {pattern!r} "
                              f"in {list(skip)!r}")
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise ConfigError(f"skip pattern {pattern!r} is not a valid regular expression ({err})") from None
    return tuple(skip)


def _check_kv_scale(value: Any) -> str | float:
    allowed = f"{', '.join(KV_SCALE_MODES)} or a positive finite number"
    if isinstance(value, str):
        if value in KV_SCALE_MODES:
            return value
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"kv_scale={value!r} is invalid; allowed: {allowed}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"kv_scale={value!r} is invalid; allowed: {allowed}")
    return float(value)


def resolve_config(value: str | Path | RolloutConfig | None, source: str = "config") -> RolloutConfig:
    """A scheme name (``int8``), a YAML path or a config passes through; None gives the defaults.

    Errors name `source` (e.g. ``FLASHRL_CONFIG``), the value and the allowed values.
    """
    if value is None:
        return RolloutConfig()
    if isinstance(value, RolloutConfig):
        return value
    text = str(value).strip()
    if text.lower() in SCHEMES:
        return RolloutConfig(quant=text.lower())
    path = Path(text).expanduser()
    if text and (path.is_file() or text.lower().endswith(_YAML_SUFFIXES) or os.sep in text):
        if not path.is_file():
            raise ConfigFileNotFoundError(f"{source}: config file {text!r} does not exist")
        try:
            return RolloutConfig.from_yaml(path)
        except ConfigError as err:
            raise ConfigError(f"{source}={text!r}: {err}") from None
    raise ConfigError(f"{source}={text!r} is invalid; allowed: {', '.join(SCHEMES)} or a path to a .yaml file")


def parse_bool(name: str, value: str) -> bool:
    """'1'/'true'/'yes'/'on' -> True, '0'/'false'/'no'/'off' -> False (any case); else ConfigError naming `name`."""
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is invalid; allowed: {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def _env_value(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value, or None when it is unset or empty (an empty variable is ignored)."""
    value = env.get(name)
    return value if value is not None and value.strip() else None


def from_env(environ: Mapping[str, str] | None = None) -> RolloutConfig | None:
    """The rollout config that FLASHRL_CONFIG and FLASHRL_LMHEAD_FP32 ask for, or None when both are
    unset (or empty). FLASHRL_LMHEAD_FP32 overrides the config's `lm_head_fp32` (also a file's).
    Raises `ConfigError` naming the variable on a bad value."""
    env = os.environ if environ is None else environ
    config_value, head_value = _env_value(env, "FLASHRL_CONFIG"), _env_value(env, "FLASHRL_LMHEAD_FP32")
    if config_value is None and head_value is None:
        return None
    config = resolve_config(config_value, source="FLASHRL_CONFIG") if config_value else RolloutConfig()
    if head_value is not None:
        values = config.to_dict()
        values["lm_head_fp32"] = parse_bool("FLASHRL_LMHEAD_FP32", head_value)
        config = RolloutConfig.from_dict(values)
    return config


def parse_logging_level(value: str, name: str = "FLASHRL_LOGGING_LEVEL") -> str:
    level = value.strip().upper()
    if level not in LOGGING_LEVELS:
        raise ConfigError(f"{name}={value!r} is invalid; allowed: {', '.join(LOGGING_LEVELS)}")
    return level


def configure_logging(environ: Mapping[str, str] | None = None) -> logging.Logger:
    """Apply FLASHRL_LOGGING_LEVEL / FLASHRL_LOGGING_FILE to the `flashrl` logger (never the root).

    - FLASHRL_LOGGING_LEVEL sets the logger's level. If no handler would show the records (none on
      the `flashrl` logger or its ancestors), a stderr handler is added to the `flashrl` logger.
    - FLASHRL_LOGGING_FILE adds a file handler (append mode) to the `flashrl` logger; calling again
      with another path replaces it, with the variable unset removes it.

    Idempotent: handlers added here are tagged and never duplicated. Both values are validated
    before anything changes; errors name the variable. Returns the `flashrl` logger.
    """
    env = os.environ if environ is None else environ
    logger = logging.getLogger(LOGGER_NAME)
    level_value, file_value = _env_value(env, "FLASHRL_LOGGING_LEVEL"), _env_value(env, "FLASHRL_LOGGING_FILE")
    level = parse_logging_level(level_value) if level_value is not None else None
    target = None
    if file_value is not None:
        target = Path(file_value).expanduser().resolve()
        if target.is_dir():
            raise ConfigError(f"FLASHRL_LOGGING_FILE={file_value!r} is a directory; allowed: a file path")
        if not target.parent.is_dir():
            raise ConfigError(f"FLASHRL_LOGGING_FILE={file_value!r}: directory {str(target.parent)!r} does not exist; "
                              f"allowed: a file path in an existing directory")
    ours = [h for h in logger.handlers if getattr(h, "_flashrl_env", None) == "file"]
    for handler in ours:
        if target is None or handler.baseFilename != str(target):
            logger.removeHandler(handler)
            handler.close()
    if target is not None and not any(isinstance(h, logging.FileHandler) and h.baseFilename == str(target)
                                      for h in logger.handlers):
        try:
            handler = logging.FileHandler(target, mode="a", encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"FLASHRL_LOGGING_FILE={file_value!r} cannot be opened: {err}") from None
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._flashrl_env = "file"  # type: ignore[attr-defined]
        logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
        if not logger.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            handler._flashrl_env = "stream"  # type: ignore[attr-defined]
            logger.addHandler(handler)
    return logger
