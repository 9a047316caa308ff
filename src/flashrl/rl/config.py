"""`TrainConfig`: every setting of `flashrl train`, as nested groups, with YAML files, dotted
``--group.key value`` flags and presets.

    TrainConfig
      model                       the policy checkpoint (None: the built-in tiny model)
      data: DataConfig            prompts, answers and the reward
      rollout: TrainRolloutConfig  every rollout setting: quantization (the core RolloutConfig),
                                  engine dtype, backend and its kwargs, max_batch, shards
        workers: WorkersConfig    the Ray rollout workers (flashrl.distributed.config)
      correction: CorrectionConfig  importance weights and rejection (flashrl.correction)
      algo: AlgoConfig            sampling, advantages, loss and optimizer
      run: RunConfig              length, seed, trainer device, outputs, checkpoints

Precedence (`flashrl.rl.config_build.build_config`): dataclass defaults < preset (`--preset`,
default `tiny-cpu`) < YAML file (`--config`, the same nesting) < command-line flags. The flat
names of flashrl 0.1 (``--rollout-quant``, ``tis_cap``) and the rollout settings that moved into
the rollout group (``--run.backend``, ``--rollout-workers``) are refused, naming the new name
(`flashrl.rl.renamed`). A nested group is one more dot: ``--rollout.workers.count 2``. Validation
errors name the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from flashrl.correction import AGGREGATIONS, CorrectionConfig
from flashrl.errors import ConfigError
from flashrl.fileio import atomic_write_text
from flashrl.rl.algo import ADVANTAGES
from flashrl.rl.compare import compare_variants
from flashrl.rl.config_checks import check_numbers, check_policy_loss, check_workers
from flashrl.rl.config_rollout import TrainRolloutConfig
from flashrl.rl.data import DataConfig, prompt_source
from flashrl.rl.policy_loss import POLICY_LOSSES
from flashrl.rl.renamed import RENAMED, refuse
from flashrl.rl.rewards import REWARDS

TRAINER_DTYPES = ("fp32", "bf16")
RESUME_FREE_FIELDS = (
    "run.steps",
    "algo.lr",
    "run.output_dir",
    "run.save_every",
    "run.keep_last",
    "run.resume",
    "run.resume_allow_changes",
    "run.overwrite",
    "run.plot",
    "run.log_weight_changes",
    "run.samples_per_step",
    "run.print_samples_every",
    "run.compare",
    "run.device",
    "run.micro_batch_size",
    "rollout.max_batch",
    "rollout.backend_kwargs",
    *(f"rollout.workers.{name}" for name in ("count", "address", "cpus", "gpus", "threads")),
    *(f"rollout.workers.{name}" for name in ("payload", "bucket_mb", "timeout")),
    "rollout.workers.delta_full_every",
)
"""Fields a resumed run may change freely (length, learning rate, outputs, machine layout); every
other field must match the checkpoint's config unless named in ``run.resume_allow_changes``."""


@dataclass
class AlgoConfig:
    """What one RL step computes: the sampled policy, advantages, the loss and the optimizer."""

    batch_size: int = 128
    """Sequences per step: prompts per step times group_size."""
    group_size: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_prompt_tokens: int = 64
    max_response_tokens: int = 16
    advantage: str = "grpo"
    norm_adv_by_std: bool = True
    policy_loss: str = "ppo_clip"
    """A name of `flashrl.rl.policy_loss.POLICY_LOSSES`: ppo_clip, gspo, reinforce."""
    loss_aggregation: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    mini_batches: int = 1
    """Optimizer steps per rollout batch (1 = on-policy)."""
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    kl_coef: float = 0.0
    """Weight of a k3 KL penalty to the initial policy (0 = no reference model)."""
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False
    routing_replay: bool = False
    """MoE models: the trainer's forward uses the experts the rollout engine chose for each token
    (`flashrl.rl.routing_replay`; built-in engine in the trainer's process)."""


@dataclass
class RunConfig:
    """How the run is laid out: its length, the trainer's machine, outputs and checkpoints."""

    steps: int = 60
    seed: int = 0
    device: str | None = None
    trainer_dtype: str = "fp32"
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    output_dir: str = "runs/flashrl"
    save_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_last: int | None = None
    """Keep only the N newest checkpoints; None keeps all."""
    resume: str | None = None
    """'latest' (newest complete checkpoint in output_dir) or a checkpoint directory."""
    resume_allow_changes: str | None = None
    """Comma-separated fields (e.g. run.seed,rollout.quant, or a group such as rollout) that may
    differ from the resumed checkpoint's config beyond RESUME_FREE_FIELDS, or 'all'."""
    overwrite: bool = False
    """Let a fresh run delete the run already in output_dir (its metrics, checkpoints, plots), and a
    resume from an older checkpoint delete the newer ones."""
    plot: bool = True
    samples_per_step: int = 4
    """Rollouts written to samples.jsonl per step (one per prompt group; 0: none)."""
    print_samples_every: int = 50
    """Print a few of them every N steps (0: never)."""
    log_weight_changes: bool = False
    """Log the fraction of stored rollout weights (quantized codes and high-precision values) each
    weight update changed (`weight_update/*_changed_frac`; built-in engine in the trainer's process; one
    clone and compare per tensor)."""
    compare: str | None = None
    """Comma-separated rollout precisions to run one after another with the same seed and data,
    e.g. 'bf16,int8,int8-notis,fp8' ('-notis' sets correction.weight none)."""


GROUPS: dict[str, type] = {
    "data": DataConfig,
    "rollout": TrainRolloutConfig,
    "correction": CorrectionConfig,
    "algo": AlgoConfig,
    "run": RunConfig,
}
"""The groups of `TrainConfig`, in order (`group_classes` adds the nested ones)."""


@dataclass
class TrainConfig:
    """Every setting of one training run (see the module doc for the groups)."""

    model: str | None = None
    """Hugging Face checkpoint directory; None uses the built-in tiny model (built on first use)."""
    data: DataConfig = field(default_factory=DataConfig)
    rollout: TrainRolloutConfig = field(default_factory=TrainRolloutConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ConfigError naming the first invalid field (dotted) and what is allowed."""
        d, a, r = self.data, self.algo, self.run
        choices = {
            "algo.advantage": (a.advantage, ADVANTAGES),
            "data.reward": (d.reward, tuple(REWARDS)),
            "algo.loss_aggregation": (a.loss_aggregation, AGGREGATIONS),
            "algo.policy_loss": (a.policy_loss, tuple(POLICY_LOSSES)),
            "run.trainer_dtype": (r.trainer_dtype, TRAINER_DTYPES),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is invalid; allowed: {', '.join(allowed)}")
        positive = {
            "run.steps": r.steps,
            "algo.batch_size": a.batch_size,
            "algo.group_size": a.group_size,
            "algo.mini_batches": a.mini_batches,
            "run.micro_batch_size": r.micro_batch_size,
            "algo.max_prompt_tokens": a.max_prompt_tokens,
            "algo.max_response_tokens": a.max_response_tokens,
        }
        for name in ("samples_per_step", "print_samples_every"):
            value = getattr(r, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"run.{name}={value!r} must be an integer >= 0")
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        self._check_batch()
        if self.data.path is None:  # the built-in task's operands and template, before any work
            prompt_source(self.data, r.seed)
        check_numbers(self)  # finite floats; lr, decay, penalties, save_every, workers, output_dir
        check_policy_loss(a)
        if self.correction.mode == "bypass" and a.mini_batches > 1:
            raise ConfigError(
                "correction.mode='bypass' takes the PPO ratio against the rollout "
                "policy; use algo.mini_batches=1"
            )
        keep = r.keep_last
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(
                f"run.keep_last={keep!r} must be a positive integer (or none to keep "
                f"every checkpoint)"
            )
        check_workers(self)
        self.resume_allowed()
        if r.compare:
            compare_variants(r.compare)

    def _check_batch(self) -> None:
        a = self.algo
        if a.batch_size % a.group_size:
            raise ConfigError(
                f"algo.batch_size={a.batch_size} is not divisible by "
                f"algo.group_size={a.group_size}; batch_size counts sequences "
                f"(prompts per step x group_size)"
            )
        mini = a.batch_size // a.mini_batches
        if mini * a.mini_batches != a.batch_size or mini % a.group_size:
            raise ConfigError(
                f"algo.batch_size={a.batch_size} must split into "
                f"algo.mini_batches={a.mini_batches} whole groups of {a.group_size}"
            )
        if a.group_size < 2 and a.advantage != "drgrpo":
            raise ConfigError(f"algo.advantage={a.advantage!r} needs algo.group_size >= 2")

    def resume_allowed(self) -> set[str] | None:
        """Dotted fields `run.resume_allow_changes` lets differ from the checkpoint's config (None:
        all of them). A group name stands for its fields; an old flat name of flashrl 0.1 is a
        ConfigError naming its new name."""
        value = (self.run.resume_allow_changes or "").strip()
        if value.lower() in ("all", "true"):
            return None
        names, unknown = set(), []
        known = set(field_names())
        given = [n.strip() for n in value.split(",") if n.strip()]
        renamed = [n for n in given if n in RENAMED and n not in GROUPS]
        if renamed:
            raise refuse(renamed, "run.resume_allow_changes")
        for name in given:
            matched = {k for k in known if k == name or k.startswith(name + ".")}
            names |= matched
            if not matched:
                unknown.append(name)
        if unknown:
            raise ConfigError(
                f"run.resume_allow_changes names unknown field(s) "
                f"{', '.join(sorted(unknown))}; allowed: 'all' or comma-separated "
                f"TrainConfig fields or groups, e.g. run.seed,rollout.quant"
            )
        return names

    def to_dict(self) -> dict[str, Any]:
        """The nested config as plain YAML / JSON data (tuples become lists)."""
        out: dict[str, Any] = {"model": self.model}
        for name in GROUPS:
            out[name] = _plain(dataclasses.asdict(getattr(self, name)))
        return out

    def flat_dict(self) -> dict[str, Any]:
        """``{"model": ..., "algo.lr": ..., ...}``: every field under its dotted name."""
        return flatten(self.to_dict())

    def save_yaml(self, path: str | Path) -> Path:
        return atomic_write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    def replace(self, values: dict[str, Any]) -> TrainConfig:
        """A copy with dotted fields replaced (typed values; ``rollout.workers.count`` too),
        validated."""
        return _replace(self, values)


def _replace(obj: Any, values: dict[str, Any]) -> Any:
    """`dataclasses.replace` of `obj` and its nested dataclasses, by dotted field names."""
    nested: dict[str, dict[str, Any]] = {}
    top = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[key] = value
    for head, changes in nested.items():
        top[head] = _replace(getattr(obj, head), changes)
    return dataclasses.replace(obj, **top)


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def flatten(nested: dict[str, Any]) -> dict[str, Any]:
    """Nested groups to dotted keys: ``{"algo": {"lr": 1}}`` -> ``{"algo.lr": 1}``,
    ``{"rollout": {"workers": {"count": 2}}}`` -> ``{"rollout.workers.count": 2}``."""
    groups = group_classes()
    out: dict[str, Any] = {}

    def walk(prefix: str, mapping: dict[str, Any]) -> None:
        for key, value in mapping.items():
            name = f"{prefix}{key}"
            if name in groups and isinstance(value, dict):
                walk(name + ".", value)
            else:
                out[name] = value

    walk("", nested)
    return out


@functools.cache
def group_classes() -> dict[str, type]:
    """Every group of `TrainConfig` by dotted name, the nested ones after their parent:
    ``data``, ``rollout``, ``rollout.workers``, ... (a field whose type is a dataclass)."""
    out: dict[str, type] = {}

    def visit(name: str, cls: type) -> None:
        out[name] = cls
        hints = get_type_hints(cls)
        for f in fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                visit(f"{name}.{f.name}", hints[f.name])

    for name, cls in GROUPS.items():
        visit(name, cls)
    return out


def field_names() -> list[str]:
    """Every dotted field name of `TrainConfig`, in order (nested groups: their fields)."""
    return list(field_types())


def field_types() -> dict[str, Any]:
    """Dotted field name -> type hint, for every field that is not itself a group."""
    groups = group_classes()
    out = {"model": get_type_hints(TrainConfig)["model"]}
    for group, cls in groups.items():
        hints = get_type_hints(cls)
        names = (f"{group}.{f.name}" for f in fields(cls))
        out.update({name: hints[name.rpartition(".")[2]] for name in names if name not in groups})
    return out
