"""`RolloutConfig`: how the rollout policy is quantized and how logprobs are returned; YAML files.

The values a config may hold are defined here once (`SCHEME_NAMES`, `KV_CACHE_DTYPES`, ...), so
this module imports nothing of flashrl's numerics: `flashrl.quant` defines what each scheme does
(a test checks that its `SCHEMES` are exactly `SCHEME_NAMES`). `resolve_config` turns a scheme
name or a YAML path into a config; `flashrl.core.env` reads the FLASHRL_* environment variables.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from flashrl.core.fields import check_fields, choice, setting
from flashrl.errors import ConfigError
from flashrl.fileio import atomic_write_text, check_input_file

SCHEME_NAMES = ("bf16", "int8", "fp8", "fp8_channel", "fp8_block", "int8_g128", "int8_g64")
"""The weight schemes of `flashrl.quant.SCHEMES`, by name."""
DEFAULT_SKIP: tuple[str, ...] = ("lm_head", "*.mlp.gate")
"""Kept in high precision by default: the LM head (logprob accuracy) and MoE routers. Embeddings and
norms are not `nn.Linear` and are never touched."""
KV_CACHE_DTYPES = ("bf16", "fp8")
"""``bf16``: K and V in the activation dtype (not quantized); ``fp8``: e4m3 codes, fp32 scales."""
KV_SCALE_MODES = ("calibrated", "dynamic")
KV_SCALE_GRANULARITIES = ("layer", "head", "token")
"""fp8 KV scales: one per layer, one per kv head (both static), or per token and head (dynamic)."""
LOGPROB_MODES = ("processed", "raw")
SYNC_ROUNDINGS = ("nearest", "stochastic")
_YAML_SUFFIXES = (".yaml", ".yml")


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A config file named by an option or variable does not exist (also a FileNotFoundError)."""


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping (PyYAML keeps the last silently)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key repeated in one mapping, naming both lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<`` merge keys may repeat; PyYAML resolves them
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first is not key_node.start_mark:
                raise DuplicateKeyError(
                    problem=f"key {key!r} is given twice in one mapping, on "
                    f"{_where(first, key_node.start_mark)}; PyYAML would keep the last one "
                    f"silently: keep one of them",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _where(first: yaml.Mark, second: yaml.Mark) -> str:
    if first.line != second.line:
        return f"lines {first.line + 1} and {second.line + 1}"
    return f"line {first.line + 1} (columns {first.column + 1} and {second.column + 1})"


def read_yaml(
    path: str | Path, what: str = "config file", keys: str = "config keys"
) -> dict[Any, Any]:
    """The mapping of `keys` a YAML file holds (an empty file: {}), parsed with a `yaml.SafeLoader`
    (tags that build Python objects are refused, never run) that also refuses a key repeated in
    one mapping. Every error is a one-line `ConfigError` naming the file (`what` says which file
    it is)."""
    path = check_input_file(path, what, "a YAML file", ConfigError, ConfigFileNotFoundError)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{what} {str(path)!r} cannot be read ({err.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not valid YAML (not UTF-8 text: byte {err.start})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no tag runs code
    except DuplicateKeyError as err:
        raise ConfigError(f"{path}: {err.problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(err)})") from None
    if not isinstance(data, dict | None):
        raise ConfigError(f"{path}: expected a mapping of {keys}, got {type(data).__name__}")
    return data or {}


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error as one line: where and what (PyYAML's own text spans several lines)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if problem is None:
        return " ".join(str(err).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(err, "context", None)
    return where + " ".join((f"{problem}" + (f" ({context})" if context else "")).split())


def scheme_name(scheme: Any) -> str:
    """The canonical name of a weight scheme: a name of `SCHEME_NAMES` in any case (or an object
    with such a ``name``, e.g. a `flashrl.quant.QuantScheme`); else a `ConfigError`."""
    name = scheme if isinstance(scheme, str) else getattr(scheme, "name", None)
    if not isinstance(name, str) or name.strip().lower() not in SCHEME_NAMES:
        allowed = ", ".join(SCHEME_NAMES)
        raise ConfigError(f"unknown quantization scheme {scheme!r}; allowed: {allowed}")
    return name.strip().lower()


def _check_smooth(smooth: Any) -> Any:
    if smooth is None or (
        not isinstance(smooth, bool) and isinstance(smooth, int | float) and 0 < smooth <= 1
    ):
        return smooth
    raise ConfigError(f"smooth={smooth!r} is invalid; allowed: a number in (0, 1], or null")


def _check_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"lm_head_fp32 must be true or false, got {value!r}")


def _check_skip(skip: Any) -> tuple[str, ...]:
    if isinstance(skip, str) or not isinstance(skip, (list, tuple)):
        raise ConfigError(f"skip must be a list of module-name patterns, got {skip!r}")
    for pattern in skip:
        if not isinstance(pattern, str) or not pattern.strip():
            raise ConfigError(
                f"skip must be a list of non-empty module-name patterns, "
                f"got {pattern!r} in {list(skip)!r}"
            )
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise ConfigError(
                    f"skip pattern {pattern!r} is not a valid regular expression ({err})"
                ) from None
    return tuple(skip)


def _check_kv_scale(value: Any) -> str | float:
    allowed = f"{', '.join(KV_SCALE_MODES)} or a positive finite number"
    if isinstance(value, str):
        if value in KV_SCALE_MODES:
            return value
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"kv_scale={value!r} is invalid; allowed: {allowed}") from None
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"kv_scale={value!r} is invalid; allowed: {allowed}")
    return float(value)


@dataclass(frozen=True)
class RolloutConfig:
    """How the rollout policy is quantized and how logprobs are returned."""

    quant: str = setting("bf16", check=scheme_name)
    """Weight scheme: one of `SCHEME_NAMES`."""
    skip: tuple[str, ...] = setting(DEFAULT_SKIP, check=_check_skip)
    """Linear layers kept in high precision (globs over module names, or ``re:`` regexes)."""
    kv_cache_dtype: str = choice("bf16", KV_CACHE_DTYPES)
    """KV cache: ``bf16`` (the activation dtype, not quantized) or ``fp8`` (e4m3 codes, fp32
    scales; docs/kv_cache.md)."""
    kv_scale: str | float = setting("calibrated", check=_check_kv_scale)
    """FP8 KV scales: recalibrated after each weight update, computed per step, or a fixed float."""
    lm_head_fp32: bool = setting(False, check=_check_bool)
    """Compute the LM head in fp32 (logits and logprobs a little closer to an fp32 trainer)."""
    logprobs_mode: str = choice("processed", LOGPROB_MODES)
    """Rollout logprobs under the distribution sampled from, after temperature and top-k/top-p
    (``processed``, what importance sampling needs), or of the raw logits (``raw``)."""
    sync_rounding: str = choice("nearest", SYNC_ROUNDINGS)
    """How updated weights are rounded to the rollout grid (bf16 values, int8 / fp8 codes):
    ``nearest``, or ``stochastic`` (unbiased, so updates below half a grid step survive on
    average; built-in engine only, not for MoE experts). See docs/real-model.md."""
    smooth: float | None = setting(None, check=_check_smooth)
    """Online SmoothQuant exponent a in (0, 1], factors recomputed at every weight update
    (`flashrl.quant.smoothing`); None: off. Built-in engine and vLLM plugin; not for MoE experts."""

    def __post_init__(self) -> None:
        check_fields(self, of=RolloutConfig)  # a subclass checks its own fields
        if self.kv_scale != "calibrated" and self.kv_cache_dtype != "fp8":
            raise ConfigError(
                f"kv_scale={self.kv_scale!r} applies to kv_cache_dtype='fp8' only; this config has "
                f"kv_cache_dtype={self.kv_cache_dtype!r}: set kv_cache_dtype to fp8 or leave "
                "kv_scale at calibrated"
            )
        if self.smooth is not None and self.quant == "bf16":
            raise ConfigError(
                "smooth needs a quantized scheme (quant='bf16' quantizes no activations); "
                "set quant to int8, fp8, ... or drop smooth"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> RolloutConfig:
        """Build from a mapping of field values; unknown keys raise, naming `source` and the
        allowed keys."""
        if not isinstance(values, Mapping):
            kind = type(values).__name__
            raise ConfigError(f"{source}: expected a mapping of config keys, got {kind}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed), key=str)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(map(str, unknown))}; "
                f"allowed: {', '.join(allowed)}"
            )
        try:
            return cls(**values)
        except ConfigError as err:
            if source == "config":
                raise
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> RolloutConfig:
        """Read a YAML file of config keys (top level, or under a ``rollout:`` key)."""
        path = Path(path)
        data = read_yaml(path)
        if "rollout" in data:
            if set(data) != {"rollout"}:
                extra = ", ".join(sorted(map(str, set(data) - {"rollout"})))
                raise ConfigError(
                    f"{path}: keys {extra} next to 'rollout:'; "
                    "put every config key under 'rollout:'"
                )
            return cls.from_dict(data["rollout"] or {}, source=f"{path} (rollout)")
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["skip"] = list(self.skip)
        return values

    def to_yaml(self, path: str | Path, header: str = "") -> Path:
        """Write the config as YAML, preceded by `header` as ``#`` comment lines; `from_yaml` reads
        it back."""
        comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
        text = comments + yaml.safe_dump(self.to_dict(), sort_keys=False)
        return atomic_write_text(path, text)


def resolve_config(
    value: str | Path | RolloutConfig | None, source: str = "config"
) -> RolloutConfig:
    """A scheme name (``int8``), a YAML path or a config passes through; None gives the defaults.

    Errors name `source` (e.g. ``FLASHRL_CONFIG``), the value and the allowed values. A subclass
    with fields of its own (the training config's rollout group) is refused: an engine would ignore
    them silently.
    """
    if value is None:
        return RolloutConfig()
    if isinstance(value, RolloutConfig):
        own = {f.name for f in fields(RolloutConfig)}
        extra = [f.name for f in fields(value) if f.name not in own]
        if extra:
            raise ConfigError(
                f"{source}: a {type(value).__name__} holds fields a rollout engine does not read "
                f"({', '.join(extra)}); pass its RolloutConfig part (as_rollout_config())"
            )
        return value
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(
            f"{source} must be a scheme name, a YAML path or a RolloutConfig, got a "
            f"{type(value).__name__}"
        )
    text = str(value).strip()
    if text.lower() in SCHEME_NAMES:
        return RolloutConfig(quant=text.lower())
    path = Path(text).expanduser()
    if text and (path.is_file() or text.lower().endswith(_YAML_SUFFIXES) or os.sep in text):
        check_input_file(
            path, f"{source}: config file", "a YAML file", ConfigError, ConfigFileNotFoundError
        )
        try:
            return RolloutConfig.from_yaml(path)
        except ConfigError as err:
            raise ConfigError(f"{source}={text!r}: {err}") from None
    allowed = f"{', '.join(SCHEME_NAMES)} or a path to a .yaml file"
    raise ConfigError(f"{source}={text!r} is invalid; allowed: {allowed}")
