"""`build_config`: a preset, a YAML file and command-line flags merged into a `TrainConfig`.

Every layer is a mapping in one of two spellings, both read the same way: nested like the YAML
file (``algo: {lr: 0.001}``, ``rollout: {workers: {count: 2}}``) or dotted like the flags
(``algo.lr``, ``rollout.workers.count``). An old name (flashrl 0.1's ``lr``, ``tis_cap``; a rollout
setting of the run group, ``run.backend``) is a ConfigError naming its new name
(`flashrl.rl.renamed`). Values are converted to the field's type (`flashrl.rl.values.coerce`);
the correction group is parsed by `CorrectionConfig.from_dict` (it takes verl-style strings such
as ``"0.5_5.0"``).

``rollout.file`` names a rollout config (a ``flashrl.yaml`` from `flashrl setup`, or a scheme
name): it is the base of the core `RolloutConfig` fields of the rollout group, and those set in
the YAML file or on the command line override it (a preset's do not: the file names its own
scheme). The engine and worker fields (``rollout.dtype``, ``rollout.workers.count``) are not in
such a file and come from every layer as usual.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flashrl.core.config import read_yaml, resolve_config
from flashrl.correction import CorrectionConfig
from flashrl.distributed.config import WorkersConfig
from flashrl.errors import CheckpointError, ConfigError
from flashrl.rl.config import GROUPS, TrainConfig, field_types, flatten, group_classes
from flashrl.rl.config_rollout import CORE_FIELDS, TrainRolloutConfig
from flashrl.rl.presets import PRESETS
from flashrl.rl.renamed import RENAMED, is_renamed, refuse
from flashrl.rl.values import coerce

ROLLOUT_FILE = "rollout.file"
_EXTRA_TYPES = {ROLLOUT_FILE: str | None}
_CORRECTION_STRINGS = ("correction.band", "correction.rejection", "correction.rejection_thresholds")


def layer_values(layer: Mapping[Any, Any], source: str, path: str | None = None) -> dict[str, Any]:
    """One layer (nested or dotted names) as typed values under dotted names; an old name, an
    unknown key, or a field the layer sets twice (say ``algo.lr`` and ``algo: {lr}``) to different
    values is a ConfigError naming `path` (or `source`) and what to write instead."""
    items: list[tuple[Any, Any, str]] = []  # (dotted key, value, the key as the layer spells it)
    for key, value in layer.items():
        items += _items(key, value, str(key), path or source)
    renamed = [str(key) for key, value, _ in items if is_renamed(key, value)]
    if renamed:
        raise refuse(renamed, path or source)
    types = {**field_types(), **_EXTRA_TYPES}
    unknown = sorted(str(k) for k, _, _ in items if k not in types)
    if unknown:
        allowed = ", ".join(types)
        raise ConfigError(
            f"unknown config key(s) in {path or source}: {', '.join(unknown)}; allowed: {allowed}"
        )
    return _typed_once(items, types, source, path)


def _items(key: Any, value: Any, spelled: str, where: str) -> list[tuple[Any, Any, str]]:
    """(dotted key, value, spelling) of one entry, a group's mapping opened into its fields."""
    groups = group_classes()
    if key not in groups or is_renamed(key, value):  # ``data: d.jsonl`` is flashrl 0.1's path
        return [(key, value, spelled)]
    if value is None:  # an empty group in YAML (``rollout:``)
        return []
    if not isinstance(value, Mapping):
        names = ", ".join(f"{key}.{name}" for name in groups[key].__dataclass_fields__)
        raise ConfigError(
            f"{where}: {key} must be a mapping of {groups[key].__name__} fields ({names}), "
            f"got {value!r}"
        )
    out = []
    for name, v in value.items():
        out += _items(f"{key}.{name}", v, f"{spelled}: {name}", where)
    return out


def _typed_once(
    items: list[tuple[Any, Any, str]], types: dict[str, Any], source: str, path: str | None
) -> dict[str, Any]:
    """The typed values of one layer's items; a field given twice must get the same value (nested
    and dotted, a short flag and its dotted name), else a ConfigError naming both spellings."""
    out: dict[str, Any] = {}
    first: dict[str, tuple[str, Any]] = {}
    for key, raw, spelled in items:
        value = _typed(key, types[key], raw, path)
        if key in out and not _same(out[key], value):
            other, other_raw = first[key]
            raise ConfigError(
                f"{path or source}: {other}={other_raw!r} and {spelled}={raw!r} set the same "
                f"field {key} to different values; give it once, as {key}"
            )
        first.setdefault(key, (spelled, raw))
        out[key] = value
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal values, or strings and numbers of the same number (correction fields stay strings
    until `CorrectionConfig.from_dict` parses them)."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _typed(key: str, hint: Any, value: Any, path: str | None) -> Any:
    if key.startswith("correction."):  # parsed by CorrectionConfig.from_dict
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        return str(value) if key in _CORRECTION_STRINGS and numeric else value
    if key == "rollout.backend_kwargs" and isinstance(value, dict):
        value = json.dumps(value)  # a YAML mapping of backend (vllm.LLM) arguments
    return coerce(key, hint, value, path)


def from_values(values: Mapping[str, Any], explicit: set[str] | None = None) -> TrainConfig:
    """A validated `TrainConfig` from typed dotted values; `explicit` names the rollout fields that
    override a ``rollout.file`` (default: every one given)."""
    explicit = set(values) if explicit is None else explicit
    groups: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
    for key, value in values.items():
        group, _, name = key.partition(".")
        if name:
            groups[group][name] = value
    built: dict[str, Any] = {
        "rollout": _rollout(groups["rollout"], explicit),
        "correction": CorrectionConfig.from_dict(groups["correction"]),
    }
    for name in ("data", "algo", "run"):
        built[name] = GROUPS[name](**groups[name])
    return TrainConfig(model=values.get("model"), **built)


def _rollout(values: dict[str, Any], explicit: set[str]) -> TrainRolloutConfig:
    """The rollout group: a ``rollout.file``'s core fields (if one is named) under the explicit
    ones, the engine fields, and the workers group."""
    values = dict(values)
    file = values.pop("file", None)
    base: dict[str, Any] = {}
    if file:
        base = resolve_config(file, source=ROLLOUT_FILE).to_dict()
        values = {
            k: v for k, v in values.items() if k not in CORE_FIELDS or f"rollout.{k}" in explicit
        }
    workers = {k[len("workers.") :]: v for k, v in values.items() if k.startswith("workers.")}
    own = {k: v for k, v in values.items() if not k.startswith("workers.")}
    return TrainRolloutConfig(**{**base, **own}, workers=WorkersConfig(**workers))


def build_config(
    preset: str | None, yaml_path: str | None, overrides: Mapping[str, Any]
) -> TrainConfig:
    """Merge preset < YAML < overrides into a validated `TrainConfig`; unknown keys are errors."""
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    values = layer_values(PRESETS[preset], f"preset {preset}") if preset else {}
    explicit: set[str] = set()
    yaml_layer = read_yaml(yaml_path, keys="TrainConfig fields") if yaml_path else {}
    for source, path, layer in (
        ("YAML", str(yaml_path), yaml_layer),
        ("overrides", None, overrides),
    ):
        typed = layer_values(layer, source, path)
        values.update(typed)
        explicit |= set(typed)
    return from_values(values, explicit)


def stored_values(stored: Mapping[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """The dotted values of the config a checkpoint (named `source`) stores. Read into a
    `TrainConfig` where it still validates, so that both sides of a resume comparison spell values
    alike; else the values as stored. A config in old names (flashrl 0.1's flat ones, or rollout
    settings stored under ``run``) is a CheckpointError: it is not translated, and a comparison
    under new names would find no field to compare."""
    renamed = [str(key) for key, value in flatten(dict(stored)).items() if is_renamed(key, value)]
    if renamed:
        moved = ", ".join(f"{name} (now {RENAMED[name]})" for name in renamed)
        raise CheckpointError(
            f"{source} stores its config under old names ({moved}), which are no longer read, "
            f"so it cannot be compared with this run's config; pass "
            f"--run.resume-allow-changes all to resume it without the comparison"
        )
    try:
        return from_values(layer_values(stored, source)).flat_dict()
    except (ValueError, TypeError):  # ConfigError, or an old value this version refuses
        return flatten(dict(stored))
