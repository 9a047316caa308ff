"""The neutral core: what every layer of flashrl may import. It imports nothing of flashrl but
`flashrl.errors` and `flashrl.fileio`.

- `sampling`: `SamplingParams` and the processed-logprob math (`process_logits`,
  `replay_processed_logprobs`) shared by the engines and the trainer;
- `rollout`: `Rollout`, the `RolloutBackend` protocol and its stats schema (`BACKEND_STATS`);
- `config`: `RolloutConfig` and its YAML files; `env`: the FLASHRL_* environment variables;
- `device`: device and dtype choice, peak memory.
"""

from flashrl.core.config import KV_CACHE_DTYPES, SCHEME_NAMES, RolloutConfig, resolve_config
from flashrl.core.rollout import (
    BACKEND_STATS,
    BACKEND_STATS_KEYS,
    FINISH_REASONS,
    Rollout,
    RolloutBackend,
)
from flashrl.core.sampling import SamplingParams, process_logits, replay_processed_logprobs

__all__ = [
    "BACKEND_STATS",
    "BACKEND_STATS_KEYS",
    "FINISH_REASONS",
    "KV_CACHE_DTYPES",
    "SCHEME_NAMES",
    "Rollout",
    "RolloutBackend",
    "RolloutConfig",
    "SamplingParams",
    "process_logits",
    "replay_processed_logprobs",
    "resolve_config",
]
