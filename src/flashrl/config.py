"""Re-exports of `flashrl.core.config` (RolloutConfig, YAML) and `flashrl.core.env` (FLASHRL_*
variables), kept so that ``from flashrl.config import ...`` goes on working; new code imports
from `flashrl.core`."""

from flashrl.core.config import (
    KV_CACHE_DTYPES,
    KV_SCALE_MODES,
    LOGPROB_MODES,
    ConfigFileNotFoundError,
    RolloutConfig,
    read_yaml,
    resolve_config,
    yaml_problem,
)
from flashrl.core.env import (
    ENV_VARS,
    LOGGER_NAME,
    LOGGING_LEVELS,
    configure_logging,
    from_env,
    parse_bool,
    parse_logging_level,
)

__all__ = [
    "ENV_VARS",
    "KV_CACHE_DTYPES",
    "KV_SCALE_MODES",
    "LOGGER_NAME",
    "LOGGING_LEVELS",
    "LOGPROB_MODES",
    "ConfigFileNotFoundError",
    "RolloutConfig",
    "configure_logging",
    "from_env",
    "parse_bool",
    "parse_logging_level",
    "read_yaml",
    "resolve_config",
    "yaml_problem",
]
