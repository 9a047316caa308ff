"""`TrainConfig`: every setting of `flashrl train`, with YAML files, `--key value` overrides and presets.

Precedence: dataclass defaults < preset (`--preset`, default `tiny-cpu`) < YAML file (`--config`) <
command-line overrides. Every field is a `--kebab-case` flag; validation errors name the field, the
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from flashrl.config import read_yaml
from flashrl.correction import CorrectionConfig
from flashrl.errors import ConfigError
from flashrl.fileio import atomic_write_text
from flashrl.quant.schemes import SCHEMES
from flashrl.rl.algo import ADVANTAGES
from flashrl.rl.rewards import REWARDS

BACKENDS = ("builtin", "vllm")
# fields a resumed run may change freely: the length of the run, the learning rate, where outputs go
# and how the work is laid out on the machine; every other field changes what the run computes and
# must match the checkpoint's config unless named in resume_allow_changes
RESUME_FREE_FIELDS = ("steps", "lr", "output_dir", "save_every", "keep_last", "resume", "resume_allow_changes",
                      "overwrite", "plot", "compare", "device", "max_batch", "micro_batch_size", "vllm_kwargs")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
CORRECTION_WEIGHTS = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis")


@dataclass
class TrainConfig:
    # ---- model and data
    model: str | None = None
    """Hugging Face checkpoint directory; None uses the built-in tiny model (built on first use)."""
    data: str | None = None
    """A local .jsonl / .json / .parquet dataset; None uses the built-in arithmetic task."""
    prompt_field: str = "question"
    answer_field: str = "answer"
    prompt_template: str = "{prompt}"
    chat_template: bool = True
    """Wrap prompts in the model's chat template when it has one."""
    system_prompt: str | None = None
    reward: str = "exact_match"
    task_max_operand: int = 99
    task_ops: str = "+"
    # ---- rollout
    backend: str = "builtin"
    rollout_quant: str = "int8"
    rollout_config: str | None = None
    """A flashrl.yaml (from `flashrl setup`): skip list, KV cache, lm-head settings for the rollout."""
    rollout_dtype: str = "bf16"
    kv_cache_dtype: str = "bf16"
    lm_head_fp32: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_prompt_tokens: int = 64
    max_response_tokens: int = 16
    max_batch: int = 256
    """KV-cache slots of the built-in engine (sequences decoded at once)."""
    vllm_kwargs: str | None = None
    """JSON object of extra `vllm.LLM(...)` arguments for backend 'vllm', e.g. '{"enforce_eager": true}'."""
    # ---- algorithm
    steps: int = 60
    batch_size: int = 128
    """Sequences per step: prompts per step times group_size."""
    group_size: int = 8
    advantage: str = "grpo"
    norm_adv_by_std: bool = True
    loss_aggregation: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    mini_batches: int = 1
    """Optimizer steps per rollout batch (1 = on-policy)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    kl_coef: float = 0.0
    """Weight of a k3 KL penalty to the initial policy (0 = no reference model)."""
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False
    # ---- rollout correction
    correction_mode: str = "decoupled"
    correction: str = "token_tis"
    tis_cap: float = 2.0
    """C of truncated IS; 0 turns importance weighting off (mismatch is still measured)."""
    correction_band: str | None = None
    """lo_hi band on rho for token_mis / seq_mis, e.g. '0.5_5.0'."""
    rejection: str | None = None
    """Comma-separated rejection options (verl names), e.g. 'seq_mean_k1,seq_mean_k3'."""
    rejection_thresholds: str | None = None
    """One threshold per option or one for all: 'lo_hi' bands on rho for k1, upper bounds for k2/k3,
    e.g. '0.999_1.001,0.01'."""
    # ---- system
    device: str | None = None
    trainer_dtype: str = "fp32"
    seed: int = 0
    output_dir: str = "runs/flashrl"
    save_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_last: int | None = None
    """Keep only the N newest checkpoints (older ones are deleted once a new one is in place); None keeps all."""
    resume: str | None = None
    """'latest' (newest complete checkpoint in output_dir) or a checkpoint directory."""
    resume_allow_changes: str | None = None
    """Comma-separated fields that may differ from the resumed checkpoint's config beyond those that
    always may (RESUME_FREE_FIELDS), or 'all'."""
    overwrite: bool = False
    """Let a fresh run delete the run already in output_dir (its metrics, checkpoints, plots), and a
    resume from an older checkpoint delete the newer ones."""
    plot: bool = True
    compare: str | None = None
    """Comma-separated rollout precisions to run one after another with the same seed and data,
    e.g. 'bf16,int8,int8-notis,fp8' ('-notis' sets tis_cap 0)."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        choices = {
            "backend": BACKENDS, "rollout_quant": tuple(SCHEMES), "advantage": ADVANTAGES, "reward": tuple(REWARDS),
            "loss_aggregation": AGGREGATIONS, "correction": CORRECTION_WEIGHTS, "correction_mode": ("decoupled", "bypass"),
            "trainer_dtype": ("fp32", "bf16"), "rollout_dtype": ("bf16", "fp16", "fp32"), "kv_cache_dtype": ("bf16", "fp8"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid; allowed: {', '.join(allowed)}")
        positive = ("steps", "batch_size", "group_size", "mini_batches", "micro_batch_size", "max_prompt_tokens",
                    "max_response_tokens", "max_batch")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.batch_size % self.group_size:
            raise ConfigError(f"batch_size={self.batch_size} is not divisible by group_size={self.group_size}; "
                              f"batch_size counts sequences (prompts per step x group_size)")
        if (self.batch_size // self.mini_batches) * self.mini_batches != self.batch_size or \
                (self.batch_size // self.mini_batches) % self.group_size:
            raise ConfigError(f"batch_size={self.batch_size} must split into mini_batches={self.mini_batches} "
                              f"whole groups of {self.group_size}")
        if self.lr <= 0 or self.grad_clip < 0 or self.kl_coef < 0 or self.tis_cap < 0:
            raise ConfigError("lr must be > 0; grad_clip, kl_coef and tis_cap must be >= 0")
        if self.group_size < 2 and self.advantage != "drgrpo":
            raise ConfigError(f"advantage={self.advantage!r} needs group_size >= 2")
        self.correction_config()  # raises on invalid correction settings
        self.llm_kwargs()
        if self.correction_mode == "bypass" and self.mini_batches > 1:
            raise ConfigError("correction_mode='bypass' takes the PPO ratio against the rollout policy; use mini_batches=1")
        if self.keep_last is not None and (isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int)
                                           or self.keep_last < 1):
            raise ConfigError(f"keep_last={self.keep_last!r} must be a positive integer (or none to keep every checkpoint)")
        self.resume_allowed()
        if self.compare:
            from flashrl.rl.run import compare_variants

            compare_variants(self.compare)

    def resume_allowed(self) -> set[str] | None:
        """Fields `resume_allow_changes` lets differ from the checkpoint's config (None: all of them)."""
        value = (self.resume_allow_changes or "").strip()
        if value.lower() in ("all", "true"):
            return None
        names = {n.strip() for n in value.split(",") if n.strip()}
        unknown = sorted(names - set(TrainConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"resume_allow_changes names unknown field(s) {', '.join(unknown)}; allowed: 'all' or "
                              f"comma-separated TrainConfig fields, e.g. seed,rollout_quant")
        return names

    def correction_config(self) -> CorrectionConfig:
        """The `CorrectionConfig` these settings describe (tis_cap 0 turns the IS weight off)."""
        weight = "none" if self.tis_cap == 0 and self.correction in ("token_tis", "seq_tis") else self.correction
        values: dict[str, Any] = dict(mode=self.correction_mode, weight=weight)
        if self.tis_cap > 0:
            values["cap"] = self.tis_cap
        if self.correction_band:
            values["band"] = self.correction_band
        if self.rejection:
            values["rejection"] = self.rejection
        if self.rejection_thresholds:
            values["rejection_thresholds"] = self.rejection_thresholds
        return CorrectionConfig.from_dict(values)

    def llm_kwargs(self) -> dict[str, Any]:
        """`vllm_kwargs` parsed (a JSON object)."""
        if not self.vllm_kwargs:
            return {}
        try:
            value = json.loads(self.vllm_kwargs)
        except json.JSONDecodeError as err:
            raise ConfigError(f"vllm_kwargs={self.vllm_kwargs!r} is not valid JSON ({err.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"vllm_kwargs={self.vllm_kwargs!r} must be a JSON object")
        return value

    # ------------------------------------------------------------------ I/O

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save_yaml(self, path: str | Path) -> Path:
        return atomic_write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


def field_types() -> dict[str, Any]:
    hints = get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in fields(TrainConfig)}


_KINDS = {bool: ("a boolean", "true or false"), int: ("an integer",) * 2, float: ("a number",) * 2,
          str: ("a string",) * 2}


def coerce(name: str, value: Any, source: str | None = None) -> Any:
    """Convert a command-line string or a YAML value to the field's type (``int | None`` etc.).

    Strings are parsed (``"10"``, ``"true"``, ``"none"``); YAML values must already have the type, except
    that an int is a valid float and a number a valid string. Errors name `source` (the file), the
    field, the value and the expected type."""
    hint = field_types()[name]
    kinds = [t for t in getattr(hint, "__args__", (hint,)) if t is not type(None)]
    optional = type(None) in getattr(hint, "__args__", ())
    kind = kinds[0]
    prefix = f"{source}: " if source else ""

    def bad(detail: str = "") -> ConfigError:
        what, expected = _KINDS[kind]
        expected += " or none" if optional else ""
        return ConfigError(f"{prefix}{name}={value!r} is not {what}{detail}; expected {expected}")

    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        if not optional:
            raise ConfigError(f"{prefix}{name} cannot be empty; expected {_KINDS[kind][1]}")
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        low = value.strip().lower() if isinstance(value, str) else None
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise bad()
    if kind is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if kind is float:
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise bad() from None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise bad()
        if math.isnan(number):
            raise bad(" (NaN)")
        return number
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. `rejection_thresholds: 0.01`
    if name == "vllm_kwargs" and isinstance(value, dict):
        return json.dumps(value)  # a YAML mapping of vllm.LLM arguments
    raise bad()


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file of TrainConfig fields (`yaml.safe_load`: nothing in it can run code)."""
    data = read_yaml(path)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of TrainConfig fields, got {type(data).__name__}")
    return data


def build_config(preset: str | None, yaml_path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """Merge preset < YAML < overrides into a validated `TrainConfig`; unknown keys are errors."""
    from flashrl.rl.presets import PRESETS

    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    allowed = set(field_types())
    values: dict[str, Any] = dict(PRESETS[preset]) if preset else {}
    explicit: set[str] = set()
    layers = (("YAML", str(yaml_path), load_yaml(yaml_path) if yaml_path else {}), ("overrides", None, overrides))
    for source, path, layer in layers:
        unknown = sorted(map(str, set(layer) - allowed))
        if unknown:
            raise ConfigError(f"unknown config key(s) in {path or source}: {', '.join(unknown)}; "
                              f"allowed: {', '.join(sorted(allowed))}")
        values.update({k: coerce(k, v, path) for k, v in layer.items()})
        explicit |= set(layer)
    if values.get("rollout_config") and "rollout_quant" not in explicit:
        # a flashrl.yaml (from `flashrl setup`) names its scheme; a preset's default must not override it
        from flashrl.config import resolve_config

        values["rollout_quant"] = resolve_config(values["rollout_config"], source="rollout_config").quant
    return TrainConfig(**values)
