"""The flat `TrainConfig` names of flashrl 0.1 and their nested names, for one release.

Until 0.1 `TrainConfig` had 56 flat fields (`--rollout-quant`, `tis_cap: 2`); it now nests them
(`--rollout.quant`, `correction: {cap: 2}`). An old name in a YAML file, a flag, a
`build_config` override or `resume_allow_changes` still works: it is renamed to the new one with a
`DeprecationWarning` naming both. A checkpoint written by 0.1 stores the flat config; `upgrade`
reads it the same way, silently. Two old fields have no one-to-one new name:

- ``tis_cap: 0`` turned importance weighting off: it becomes ``correction.weight: none`` (when the
  weight is ``token_tis`` or ``seq_tis``; ``correction.cap`` keeps its default), any other value
  becomes ``correction.cap``;
- ``rollout_config: FILE`` becomes ``rollout.file``: the file is the base of the `rollout` group.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

_GROUP_FIELDS = {
    "data": (
        "prompt_field",
        "answer_field",
        "prompt_template",
        "chat_template",
        "system_prompt",
        "reward",
        "task_max_operand",
        "task_ops",
    ),
    "algo": (
        "batch_size",
        "group_size",
        "temperature",
        "top_k",
        "top_p",
        "max_prompt_tokens",
        "max_response_tokens",
        "advantage",
        "norm_adv_by_std",
        "loss_aggregation",
        "clip_low",
        "clip_high",
        "dual_clip",
        "mini_batches",
        "lr",
        "weight_decay",
        "warmup_steps",
        "grad_clip",
        "kl_coef",
        "overlong_buffer",
        "overlong_penalty",
        "dynamic_sampling",
    ),
    "run": (
        "steps",
        "seed",
        "device",
        "trainer_dtype",
        "backend",
        "rollout_dtype",
        "max_batch",
        "micro_batch_size",
        "vllm_kwargs",
        "output_dir",
        "save_every",
        "keep_last",
        "resume",
        "resume_allow_changes",
        "overwrite",
        "plot",
        "compare",
    ),
    "rejection": ("rejection", "rejection_thresholds"),
}
LEGACY_NAMES: dict[str, str] = {
    "data": "data.path",
    "rollout_quant": "rollout.quant",
    "rollout_config": "rollout.file",
    "kv_cache_dtype": "rollout.kv_cache_dtype",
    "lm_head_fp32": "rollout.lm_head_fp32",
    "correction_mode": "correction.mode",
    "correction": "correction.weight",
    "tis_cap": "correction.cap",
    "correction_band": "correction.band",
    **{name: f"correction.{name}" for name in _GROUP_FIELDS["rejection"]},
    **{
        name: f"{group}.{name}"
        for group in ("data", "algo", "run")
        for name in _GROUP_FIELDS[group]
    },
}
"""Old flat name -> new dotted name (``model`` kept its name)."""
SHORT_NAMES: dict[str, str] = {
    "rollout_workers": "run.rollout_workers",
    "ray_address": "run.ray_address",
    "async_rollouts": "run.async_rollouts",
}
"""Short flags of the distributed run (``--rollout-workers 2``, ``--ray-address auto``,
``--async-rollouts``) as spelled in issue 14: current names, not deprecated."""
TIS_CAP = "correction.tis_cap"
"""Where a legacy ``tis_cap`` waits until every layer is merged (see `resolve_tis_cap`)."""


def is_legacy(key: Any, value: Any) -> bool:
    """Whether `key: value` uses an old flat name. ``data`` and ``correction`` are old names when
    their value is not a mapping (a file path, a weight name) and group names when it is."""
    group = key in ("data", "correction") and isinstance(value, Mapping)
    return key in LEGACY_NAMES and not group


def rename(key: str, source: str, warn: bool = True) -> str:
    """The new name of the old flat `key`; a DeprecationWarning naming both unless `warn` is off."""
    new = LEGACY_NAMES[key]
    if warn:
        warnings.warn(
            f"{source}: {key} (--{key.replace('_', '-')}) is deprecated and will be "
            f"removed in the next release; use {new} (--{new.replace('_', '-')})",
            DeprecationWarning,
            stacklevel=4,
        )
    return TIS_CAP if key == "tis_cap" else new


def resolve_tis_cap(values: dict[str, Any]) -> None:
    """Turn a merged legacy ``tis_cap`` into ``correction.cap`` / ``correction.weight`` in place:
    0 switches a TIS weight off, anything else is the cap."""
    if TIS_CAP not in values:
        return
    cap = values.pop(TIS_CAP)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap == 0:
        if values.get("correction.weight", "token_tis") in ("token_tis", "seq_tis"):
            values["correction.weight"] = "none"
        values.pop("correction.cap", None)
    else:
        values["correction.cap"] = cap
