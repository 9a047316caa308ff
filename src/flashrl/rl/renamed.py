"""Old `TrainConfig` names and the dotted names that replaced them.

Until 0.1 `TrainConfig` had 56 flat fields (``--rollout-quant``, ``tis_cap: 2``); they are now
nested (``--rollout.quant``, ``correction: {cap: 2}``). Later every rollout setting moved into the
rollout group (issue 25: ``--run.backend`` is ``--rollout.backend``, the Ray fields of ``run`` and
the short ``--rollout-workers`` are ``--rollout.workers.*``). The old names are not translated: a
flag, YAML key, `build_config` override or ``run.resume_allow_changes`` entry that uses one is a
`ConfigError` naming the new name (`refuse`), and a checkpoint whose config uses one resumes only
with ``--run.resume-allow-changes all``. These tables exist only to write those messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flashrl.errors import ConfigError

_GROUP_FIELDS = {
    "data": ("prompt_field", "answer_field", "prompt_template", "chat_template", "system_prompt",
             "reward", "task_max_operand", "task_ops"),
    "algo": ("batch_size", "group_size", "temperature", "top_k", "top_p", "max_prompt_tokens",
             "max_response_tokens", "advantage", "norm_adv_by_std", "loss_aggregation", "clip_low",
             "clip_high", "dual_clip", "mini_batches", "lr", "weight_decay", "warmup_steps",
             "grad_clip", "kl_coef", "overlong_buffer", "overlong_penalty", "dynamic_sampling"),
    "run": ("steps", "seed", "device", "trainer_dtype", "micro_batch_size", "output_dir",
            "save_every", "keep_last", "resume", "resume_allow_changes", "overwrite", "plot",
            "compare"),
    "correction": ("rejection", "rejection_thresholds"),
}  # fmt: skip
"""flashrl 0.1's flat fields that kept their name, now in a group."""
_WORKERS = {
    "rollout_workers": "count",
    "ray_address": "address",
    "worker_cpus": "cpus",
    "worker_gpus": "gpus",
    "worker_threads": "threads",
    "weight_payload": "payload",
    "delta_scale_band": "delta_scale_band",
    "delta_full_every": "delta_full_every",
    "bucket_mb": "bucket_mb",
    "worker_timeout": "timeout",
    "async_rollouts": "async_rollouts",
}
MOVED: dict[str, str] = {
    "run.backend": "rollout.backend",
    "run.rollout_dtype": "rollout.dtype",
    "run.max_batch": "rollout.max_batch",
    "run.vllm_kwargs": "rollout.backend_kwargs",
    "run.worker_tp": "rollout.backend_kwargs",
    "run.rollout_shards": "rollout.shards",
    **{f"run.{old}": f"rollout.workers.{new}" for old, new in _WORKERS.items()},
    "rollout_workers": "rollout.workers.count",
    "ray_address": "rollout.workers.address",
    "async_rollouts": "rollout.workers.async_rollouts",
}
"""Issue 25: rollout settings of the run group (and the short flags of the Ray workers) -> their
home in the rollout group."""
FLAT_RENAMED: dict[str, str] = {
    "data": "data.path",
    "rollout_quant": "rollout.quant",
    "rollout_config": "rollout.file",
    "kv_cache_dtype": "rollout.kv_cache_dtype",
    "lm_head_fp32": "rollout.lm_head_fp32",
    "correction_mode": "correction.mode",
    "correction": "correction.weight",
    "tis_cap": "correction.cap",
    "correction_band": "correction.band",
    **{name: f"{group}.{name}" for group, names in _GROUP_FIELDS.items() for name in names},
    **{name: MOVED[f"run.{name}"] for name in ("backend", "rollout_dtype", "max_batch")},
    "vllm_kwargs": "rollout.backend_kwargs",
}
"""flashrl 0.1's flat name -> its dotted name today (``model`` kept its name)."""
RENAMED: dict[str, str] = {**FLAT_RENAMED, **MOVED}
"""Every old name -> its new dotted name."""
_NOTES = {
    "tis_cap": "; {old} 0 is now {correction.weight} none",
    "rollout_config": " (the rollout config file, the base of the rollout group)",
    "run.worker_tp": """ with {"tensor_parallel_size": N} (vLLM's own argument)""",
}


def is_renamed(key: Any, value: Any) -> bool:
    """Whether `key: value` uses an old flat name. ``data`` and ``correction`` are old names when
    their value is a scalar (a file path, a weight name) and group names when it is a mapping (or
    empty)."""
    group = key in ("data", "correction") and (value is None or isinstance(value, Mapping))
    return key in RENAMED and not group


def refuse(names: Iterable[str], where: str = "", flags: bool = False) -> ConfigError:
    """The error for old flat `names` used in `where` (a file, 'overrides', a field): each one named
    with its new name, as flags when `flags` (``--rollout-quant was renamed: use
    --rollout.quant``), else as keys (``rollout_quant was renamed: use rollout.quant``)."""

    def spell(dotted: str) -> str:
        return "--" + dotted.replace("_", "-") if flags else dotted

    parts = []
    for name in names:
        key = name.removeprefix("--").replace("-", "_")
        note = _NOTES.get(key, "").replace("{old}", name)
        note = note.replace("{correction.weight}", spell("correction.weight"))
        parts.append(f"{name} was renamed: use {spell(RENAMED[key])}{note}")
    prefix = f"{where}: " if where else ""
    return ConfigError(prefix + "; ".join(parts))
