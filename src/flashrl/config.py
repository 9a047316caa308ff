"""Rollout configuration: one dataclass, YAML files, and the FLASHRL_* environment variables.

| variable               | values                                                   | effect                                  |
|------------------------|----------------------------------------------------------|-----------------------------------------|
| `FLASHRL_CONFIG`       | `bf16`, `int8`, `fp8`, `fp8_channel`, `fp8_block`, or a path to a YAML file | the rollout config (scheme shorthand or file from `flashrl setup`) |
| `FLASHRL_LMHEAD_FP32`  | `1`/`true`/`yes` or `0`/`false`/`no`                      | lm head and logits in fp32 end to end   |
| `FLASHRL_LOGGING_LEVEL`| `DEBUG`, `INFO`, `WARNING`, `ERROR`, `CRITICAL`          | level of the `flashrl` logger           |
| `FLASHRL_LOGGING_FILE` | a file path                                              | also log the `flashrl` logger to it     |

The library logs under the `flashrl` logger only and never configures the root logger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.quant.schemes import SCHEMES, get_scheme

KV_CACHE_DTYPES = ("bf16", "fp8")
KV_SCALE_MODES = ("calibrated", "dynamic")
LOGPROB_MODES = ("processed", "raw")
LOGGING_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


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
        if isinstance(self.skip, str) or not all(isinstance(s, str) for s in self.skip):
            raise ValueError(f"skip must be a list of module-name patterns, got {self.skip!r}")
        object.__setattr__(self, "skip", tuple(self.skip))
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("logprobs_mode", self.logprobs_mode, LOGPROB_MODES)
        if isinstance(self.kv_scale, str) and self.kv_scale not in KV_SCALE_MODES:
            try:
                object.__setattr__(self, "kv_scale", float(self.kv_scale))
            except ValueError:
                raise ValueError(
                    f"kv_scale={self.kv_scale!r} is invalid; allowed: {', '.join(KV_SCALE_MODES)} or a positive float"
                ) from None
        if not isinstance(self.kv_scale, str) and not (float(self.kv_scale) > 0):
            raise ValueError(f"kv_scale={self.kv_scale!r} must be positive")
        if not isinstance(self.lm_head_fp32, bool):
            raise ValueError(f"lm_head_fp32 must be true or false, got {self.lm_head_fp32!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> "RolloutConfig":
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        return cls(**{k: tuple(v) if k == "skip" and isinstance(v, list) else v for k, v in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RolloutConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
        return cls.from_dict(data.get("rollout", data), source=str(path))

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["skip"] = list(self.skip)
        return values

    def to_yaml(self, path: str | Path, header: str = "") -> Path:
        path = Path(path)
        text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(self.to_dict(), sort_keys=False)
        path.write_text(text)
        return path


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {', '.join(allowed)}")


def resolve_config(value: str | RolloutConfig | None, source: str = "config") -> RolloutConfig:
    """A scheme name (``int8``), a YAML path, or a config passes through; None gives the defaults."""
    if value is None:
        return RolloutConfig()
    if isinstance(value, RolloutConfig):
        return value
    text = str(value).strip()
    if text.lower() in SCHEMES:
        return RolloutConfig(quant=text.lower())
    if text.endswith((".yaml", ".yml")) or os.sep in text:
        if not Path(text).is_file():
            raise FileNotFoundError(f"{source}: config file {text!r} does not exist")
        return RolloutConfig.from_yaml(text)
    raise ValueError(f"{source}={text!r} is invalid; allowed: {', '.join(SCHEMES)} or a path to a .yaml file")


def parse_bool(name: str, value: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is invalid; allowed: 1/true/yes/on or 0/false/no/off")


def from_env(environ: Mapping[str, str] | None = None) -> RolloutConfig | None:
    """The rollout config the FLASHRL_* variables ask for, or None when FLASHRL_CONFIG and
    FLASHRL_LMHEAD_FP32 are both unset. Raises ValueError naming the variable on a bad value."""
    env = os.environ if environ is None else environ
    config_value, head_value = env.get("FLASHRL_CONFIG"), env.get("FLASHRL_LMHEAD_FP32")
    if config_value is None and head_value is None:
        return None
    config = resolve_config(config_value, source="FLASHRL_CONFIG") if config_value else RolloutConfig()
    if head_value is not None:
        values = config.to_dict()
        values["lm_head_fp32"] = parse_bool("FLASHRL_LMHEAD_FP32", head_value)
        config = RolloutConfig.from_dict(values)
    return config


def configure_logging(environ: Mapping[str, str] | None = None) -> logging.Logger:
    """Apply FLASHRL_LOGGING_LEVEL / FLASHRL_LOGGING_FILE to the `flashrl` logger (never the root)."""
    env = os.environ if environ is None else environ
    logger = logging.getLogger("flashrl")
    level = env.get("FLASHRL_LOGGING_LEVEL")
    if level is not None:
        if level.strip().upper() not in LOGGING_LEVELS:
            raise ValueError(f"FLASHRL_LOGGING_LEVEL={level!r} is invalid; allowed: {', '.join(LOGGING_LEVELS)}")
        logger.setLevel(level.strip().upper())
    path = env.get("FLASHRL_LOGGING_FILE")
    if path:
        target = str(Path(path).resolve())
        if not any(isinstance(h, logging.FileHandler) and h.baseFilename == target for h in logger.handlers):
            handler = logging.FileHandler(target)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
    return logger
