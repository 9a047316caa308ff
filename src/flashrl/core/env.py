"""The FLASHRL_* environment variables: one parser each, errors that name the variable.

- ``FLASHRL_CONFIG``: ``bf16``, ``int8``, ``fp8``, ``fp8_channel``, ``fp8_block``, or a path to a
  YAML file: the rollout config (a scheme shorthand, or a file from ``flashrl setup``).
- ``FLASHRL_LMHEAD_FP32``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``: lm head
  and logits in fp32 end to end; overrides the file's ``lm_head_fp32``.
- ``FLASHRL_LOGGING_LEVEL``: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``, ``CRITICAL`` (any case):
  level of the ``flashrl`` logger.
- ``FLASHRL_LOGGING_FILE``: a file path (its directory must exist): also write the ``flashrl``
  logger's records to it (appended).

An unset or empty variable is ignored. A bad value raises `ConfigError` (`ConfigFileNotFoundError`,
also a FileNotFoundError, for a missing file) naming the variable and the allowed values.
`from_env()` reads the first two and returns the resolved `RolloutConfig` (None when neither is
set); `configure_logging()` applies the last two. The `flashrl` command calls
`configure_logging()` on start; a library user calls it once, explicitly: importing flashrl
configures nothing, so a bad value never breaks an import.

The library logs under the `flashrl` logger only and never configures the root logger: the
variables set the `flashrl` logger's level and add handlers to it (records still propagate to the
application's handlers as usual).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from flashrl.core.config import RolloutConfig, resolve_config
from flashrl.errors import ConfigError

LOGGING_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENV_VARS = (
    "FLASHRL_CONFIG",
    "FLASHRL_LMHEAD_FP32",
    "FLASHRL_LOGGING_LEVEL",
    "FLASHRL_LOGGING_FILE",
)
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
"""The words `parse_bool` accepts (any case)."""
LOGGER_NAME = "flashrl"


def parse_bool(name: str, value: str) -> bool:
    """'1'/'true'/'yes'/'on' -> True, '0'/'false'/'no'/'off' -> False (any case); else a
    `ConfigError` naming `name`."""
    text = value.strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    allowed = f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"
    raise ConfigError(f"{name}={value!r} is invalid; allowed: {allowed}")


def _env_value(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value, or None when it is unset or empty (an empty variable is ignored)."""
    value = env.get(name)
    return value if value is not None and value.strip() else None


def from_env(environ: Mapping[str, str] | None = None) -> RolloutConfig | None:
    """The rollout config that FLASHRL_CONFIG and FLASHRL_LMHEAD_FP32 ask for, or None when both
    are unset (or empty). FLASHRL_LMHEAD_FP32 overrides the config's `lm_head_fp32` (also a
    file's). Raises `ConfigError` naming the variable on a bad value."""
    env = os.environ if environ is None else environ
    config_value = _env_value(env, "FLASHRL_CONFIG")
    head_value = _env_value(env, "FLASHRL_LMHEAD_FP32")
    if config_value is None and head_value is None:
        return None
    config = RolloutConfig()
    if config_value:
        config = resolve_config(config_value, source="FLASHRL_CONFIG")
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


def _log_file(value: str | None) -> Path | None:
    """The resolved FLASHRL_LOGGING_FILE path, checked (None when unset)."""
    if value is None:
        return None
    target = Path(value).expanduser().resolve()
    if target.is_dir():
        raise ConfigError(f"FLASHRL_LOGGING_FILE={value!r} is a directory; allowed: a file path")
    if not target.parent.is_dir():
        raise ConfigError(
            f"FLASHRL_LOGGING_FILE={value!r}: directory {str(target.parent)!r} "
            "does not exist; allowed: a file path in an existing directory"
        )
    return target


def _set_file_handler(logger: logging.Logger, target: Path | None, value: str | None) -> None:
    """Replace the file handler this module added with one writing to `target` (None: remove)."""
    ours = [h for h in logger.handlers if getattr(h, "_flashrl_env", None) == "file"]
    for handler in ours:
        if target is None or handler.baseFilename != str(target):
            logger.removeHandler(handler)
            handler.close()
    if target is None or any(
        isinstance(h, logging.FileHandler) and h.baseFilename == str(target)
        for h in logger.handlers
    ):
        return
    try:
        handler = logging.FileHandler(target, mode="a", encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"FLASHRL_LOGGING_FILE={value!r} cannot be opened: {err}") from None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler._flashrl_env = "file"  # type: ignore[attr-defined]
    logger.addHandler(handler)


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
    level_value = _env_value(env, "FLASHRL_LOGGING_LEVEL")
    file_value = _env_value(env, "FLASHRL_LOGGING_FILE")
    level = parse_logging_level(level_value) if level_value is not None else None
    target = _log_file(file_value)
    _set_file_handler(logger, target, file_value)
    if level is not None:
        logger.setLevel(level)
        if not logger.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            handler._flashrl_env = "stream"  # type: ignore[attr-defined]
            logger.addHandler(handler)
    return logger
