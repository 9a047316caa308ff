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

from flashrl.core.fields import check_fields, choice, integer, number, setting
from flashrl.correction import CorrectionConfig
from flashrl.errors import ConfigError
from flashrl.fileio import atomic_write_text
from flashrl.rl.algo import ADVANTAGES
from flashrl.rl.compare import compare_variants
from flashrl.rl.config_checks import check_relations
from flashrl.rl.config_rollout import TrainRolloutConfig
from flashrl.rl.data import DataConfig, prompt_source
from flashrl.rl.loss import AGGREGATIONS
from flashrl.rl.policy_loss import POLICY_LOSSES
from flashrl.rl.renamed import RENAMED, refuse

TRAINER_DTYPES = ("fp32", "bf16")
MAX_LR = 1.0
"""The largest `algo.lr`: AdamW moves every weight by about lr per step, so a larger one destroys
the policy in one step (1e38 overflowed the weights to inf)."""


def _check_output_dir(path: str) -> str:
    if isinstance(path, str) and path.strip():
        return path
    raise ConfigError(
        f"run.output_dir={path!r} is empty; allowed: a directory path (created if missing), "
        f"e.g. runs/flashrl; '.' for the current directory"
    )


@dataclass
class AlgoConfig:
    """What one RL step computes: the sampled policy, advantages, the loss and the optimizer."""

    batch_size: int = integer(128)
    """Sequences per step: prompts per step times group_size."""
    group_size: int = integer(8)
    """Samples per prompt; advantages are computed within each group."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the trainer's logprobs replay it)."""
    top_k: int = 0
    """Sample from the k most likely tokens only; 0: no top-k cut."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens with this much probability; 1: no cut."""
    max_prompt_tokens: int = integer(64)
    """Prompt tokens kept per prompt (longer prompts keep their end: the question and the
    generation prompt)."""
    max_response_tokens: int = integer(16)
    """Tokens generated per response at most (a longer one is truncated)."""
    advantage: str = choice("grpo", ADVANTAGES)
    """The advantage estimator, a name of `flashrl.rl.algo.ADVANTAGES`: grpo, drgrpo, rloo."""
    norm_adv_by_std: bool = True
    """grpo: divide each group's centred rewards by their standard deviation."""
    policy_loss: str = choice("ppo_clip", POLICY_LOSSES)
    """A name of `flashrl.rl.policy_loss.POLICY_LOSSES`: ppo_clip, gspo, reinforce."""
    loss_aggregation: str = choice("token_mean", AGGREGATIONS)
    """How per-token losses become one number (verl's loss_agg_mode): token_mean,
    seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm."""
    clip_low: float = 0.2
    """PPO clip range below 1: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip range above 1: the ratio is clipped at 1 + clip_high (DAPO clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c A; None: off."""
    mini_batches: int = integer(1)
    """Optimizer steps per rollout batch (1 = on-policy)."""
    lr: float = number(
        1e-4,
        above=0,
        at_most=MAX_LR,
        note="AdamW moves each weight by about lr per step",
        resume_free=True,
    )
    """AdamW learning rate (after warmup)."""
    weight_decay: float = number(0.0, at_least=0, note="0: no weight decay")
    """AdamW weight decay (0: none)."""
    warmup_steps: int = integer(0, least=0, note="0: no warmup")
    """Steps over which the learning rate rises linearly to algo.lr (0: none)."""
    grad_clip: float = number(1.0, at_least=0, note="0: no clipping")
    """Clip the gradient's global norm to this (0: no clipping)."""
    kl_coef: float = number(0.0, at_least=0, note="0: no KL penalty")
    """Weight of a k3 KL penalty to the initial policy (0 = no reference model)."""
    overlong_buffer: int = integer(0, least=0, note="0: no overlong penalty")
    """DAPO overlong penalty: responses longer than max_response_tokens - overlong_buffer lose
    reward linearly, up to overlong_penalty at the limit (0: off)."""
    overlong_penalty: float = number(
        1.0, at_least=0, note="a negative one would reward overlong answers"
    )
    """The reward an overlong response loses at max_response_tokens (see overlong_buffer)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop the groups whose rewards are all equal (no advantage)."""
    routing_replay: bool = False
    """MoE models: the trainer's forward uses the experts the rollout engine chose for each token
    (`flashrl.rl.routing_replay`; built-in engine in the trainer's process)."""


@dataclass
class RunConfig:
    """How the run is laid out: its length, the trainer's machine, outputs and checkpoints."""

    steps: int = integer(60, resume_free=True)
    """RL steps (rollout, update, weight update) of the run."""
    seed: int = 0
    """Seeds the prompts (their order, the built-in task's problems) and the rollouts' sampling."""
    device: str | None = setting(None, resume_free=True)
    """The trainer's device: cpu, cuda or cuda:N; None: CUDA when available."""
    trainer_dtype: str = choice("fp32", TRAINER_DTYPES)
    """The trainer's weights and compute: fp32 or bf16."""
    micro_batch_size: int = integer(64, resume_free=True)
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    output_dir: str = setting("runs/flashrl", check=_check_output_dir, resume_free=True)
    """Where metrics.jsonl, samples.jsonl, checkpoints and plots go (created if missing)."""
    save_every: int = integer(0, least=0, note="0: save only at the end", resume_free=True)
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_last: int | None = integer(None, note="none: keep every checkpoint", resume_free=True)
    """Keep only the N newest checkpoints; None keeps all."""
    resume: str | None = setting(None, resume_free=True)
    """'latest' (newest complete checkpoint in output_dir) or a checkpoint directory."""
    resume_allow_changes: str | None = setting(None, resume_free=True)
    """Comma-separated fields (e.g. run.seed,rollout.quant, or a group such as rollout) that may
    differ from the resumed checkpoint's config beyond RESUME_FREE_FIELDS, or 'all'."""
    overwrite: bool = setting(False, resume_free=True)
    """Let a fresh run delete the run already in output_dir (its metrics, checkpoints, plots), and a
    resume from an older checkpoint delete the newer ones."""
    plot: bool = setting(True, resume_free=True)
    """Draw reward, mismatch and step-time plots into output_dir (needs flashrl[plot])."""
    samples_per_step: int = integer(4, least=0, note="0: none", resume_free=True)
    """Rollouts written to samples.jsonl per step (one per prompt group; 0: none)."""
    print_samples_every: int = integer(50, least=0, note="0: never", resume_free=True)
    """Print a few of them every N steps (0: never)."""
    log_weight_changes: bool = setting(False, resume_free=True)
    """Log the fraction of stored rollout weights (quantized codes and high-precision values) each
    weight update changed (`weight_update/*_changed_frac`; built-in engine in the trainer's process; one
    clone and compare per tensor)."""
    compare: str | None = setting(None, resume_free=True)
    """Comma-separated rollout precisions to run one after another with the same seed and data,
    e.g. 'bf16,int8,int8-notis,fp8' ('-notis' sets correction.weight none)."""


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
        """Raise a ConfigError naming the first invalid field (dotted) and what is allowed: each
        field's own rule (`flashrl.core.fields`; the rollout and correction groups check
        themselves when built), then what the fields need of each other."""
        for group in ("data", "algo", "run"):
            check_fields(getattr(self, group), f"{group}.")
        if self.data.path is None:  # the built-in task's operands and template, before any work
            prompt_source(self.data, self.run.seed)
        check_relations(self)
        self.resume_allowed()
        if self.run.compare:
            compare_variants(self.run.compare)

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
        return _plain(dataclasses.asdict(self))

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


def group_classes() -> dict[str, type]:
    """Every group of `TrainConfig` by dotted name, the nested ones after their parent:
    ``data``, ``rollout``, ``rollout.workers``, ... (a field whose type is a dataclass)."""
    return _tree()[0]


def field_names() -> list[str]:
    """Every dotted field name of `TrainConfig`, in order (nested groups: their fields)."""
    return list(_tree()[1])


def field_types() -> dict[str, Any]:
    """Dotted field name -> type hint, for every field that is not itself a group."""
    return {name: hint for name, (_, hint) in _tree()[1].items()}


@functools.cache
def _tree() -> tuple[dict[str, type], dict[str, tuple[dataclasses.Field, Any]]]:
    """The groups of `TrainConfig` (dotted name -> class) and its other fields (dotted name ->
    (field, type hint)), in field order."""
    groups: dict[str, type] = {}
    leaves: dict[str, tuple[dataclasses.Field, Any]] = {}

    def visit(prefix: str, cls: type) -> None:
        hints = get_type_hints(cls)
        for f in fields(cls):
            name, hint = prefix + f.name, hints[f.name]
            if dataclasses.is_dataclass(hint):
                groups[name] = hint
                visit(name + ".", hint)
            else:
                leaves[name] = (f, hint)

    visit("", TrainConfig)
    return groups, leaves


GROUPS = {name: cls for name, cls in group_classes().items() if "." not in name}
"""The groups of `TrainConfig`, in order (`group_classes` adds the nested ones)."""
RESUME_FREE_FIELDS = tuple(
    name for name, (f, _) in _tree()[1].items() if f.metadata.get("resume_free")
)
"""Fields a resumed run may change freely (length, learning rate, outputs, machine layout): those
declared with ``resume_free=True``. Every other field must match the checkpoint's config unless
named in ``run.resume_allow_changes``."""
