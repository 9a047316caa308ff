"""`flashrl setup`: a `flashrl profile` JSON turned into a rollout config file (scheme, skip list,
KV cache, lm-head precision) with a header saying where it came from."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flashrl
from flashrl.core.config import RolloutConfig
from flashrl.errors import ConfigError, InputError
from flashrl.fileio import check_input_file
from flashrl.quant.linear import DEFAULT_SKIP
from flashrl.quant.schemes import SCHEMES
from flashrl.tools.profile import SCHEMA_VERSION
from flashrl.tools.profile_metrics import recommend_skip
from flashrl.tools.profile_report import fmt


@dataclass
class SetupConfig:
    """The flags of `flashrl setup`."""

    profile: str
    """JSON written by `flashrl profile`."""
    quant: str | None = None
    """The scheme to use, among the profiled ones (needed when several were)."""
    threshold: float | None = None
    """Re-derive the skip list from the per-layer errors at this threshold (default: the
    profile's)."""
    out: str = "flashrl.yaml"
    """YAML output file."""


def _require(doc: Any, path: str, source: str, kind: type | tuple[type, ...]) -> Any:
    value = doc
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise InputError(
                f"{source}: missing field {path!r}; is this a file written by `flashrl profile`?"
            )
        value = value[key]
    numeric = kind in (int, float, (int, float))
    if not isinstance(value, kind) or (isinstance(value, bool) and numeric):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InputError(
            f"{source}: field {path!r} has type {type(value).__name__}; expected {names}"
        )
    return value


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and validate a profile JSON; errors name the file and the field."""
    path = check_input_file(path, "--profile: file", "a JSON file written by `flashrl profile`")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a JSON file ({err})") from None
    source = str(path)
    version = _require(doc, "schema_version", source, int)
    if version != SCHEMA_VERSION:
        raise InputError(
            f"{source}: schema_version {version} is not supported by this flashrl "
            f"(reads {SCHEMA_VERSION}); re-run `flashrl profile`"
        )
    schemes = _require(doc, "settings.schemes", source, list)
    _require(doc, "settings.kv_cache_dtype", source, str)
    _require(doc, "settings.lm_head_fp32", source, bool)
    _require(doc, "settings.threshold", source, (int, float))
    _require(doc, "layers", source, list)
    for s in schemes:
        if s not in SCHEMES:
            raise InputError(
                f"{source}: settings.schemes names unknown scheme {s!r}; allowed: "
                f"{', '.join(SCHEMES)}"
            )
        _require(doc, f"schemes.{s}.skip", source, list)
        _require(doc, f"schemes.{s}.mismatch", source, dict)
    for i, entry in enumerate(doc["layers"]):
        for s in schemes:
            _require(entry, f"errors.{s}.output_error", f"{source}: layers[{i}]", (int, float))
        _require(entry, "name", f"{source}: layers[{i}]", str)
        _require(entry, "engine_layer", f"{source}: layers[{i}]", str)
    return doc


def build_setup(
    profile: dict[str, Any],
    quant: str | None = None,
    threshold: float | None = None,
    source: str = "profile",
) -> tuple[RolloutConfig, str]:
    """The `RolloutConfig` for one profiled scheme and the header comment describing it.

    `quant` picks among the profiled schemes (required when several were profiled); `threshold`
    re-derives the skip list from the per-layer errors (the profile's end-to-end numbers then
    describe its own threshold, which the header says)."""
    schemes = profile["settings"]["schemes"]
    if quant is None:
        if len(schemes) != 1:
            raise ConfigError(
                f"{source} profiles {len(schemes)} schemes ({', '.join(schemes)}); "
                f"choose one with --quant"
            )
        quant = schemes[0]
    quant = quant.strip().lower()
    if quant not in schemes:
        raise ConfigError(
            f"--quant {quant!r} was not profiled in {source}; allowed: {', '.join(schemes)}"
        )
    skip = list(profile["schemes"][quant]["skip"])
    smooth = profile["schemes"][quant].get("recommended_smooth")  # absent in older profiles
    if threshold is not None:
        if not (math.isfinite(threshold) and threshold > 0):
            raise ConfigError(f"--threshold {threshold!r} is invalid; allowed: a positive number")
        flagged = recommend_skip(profile["layers"], quant, threshold)
        skip = list(DEFAULT_SKIP) + [n for f in flagged for n in f["names"]]
    try:
        settings = profile["settings"]
        config = RolloutConfig(
            quant=quant,
            skip=tuple(skip),
            kv_cache_dtype=settings["kv_cache_dtype"],
            kv_scale="calibrated",
            lm_head_fp32=settings["lm_head_fp32"],
            logprobs_mode="processed",
            smooth=smooth,
        )
    except ConfigError as err:
        raise InputError(f"{source}: schemes.{quant}: {err}") from None
    return config, _header(profile, quant, skip, threshold, source)


def _header(
    profile: dict[str, Any], quant: str, skip: list[str], threshold: float | None, source: str
) -> str:
    """The comment lines at the top of the config: where it came from and what it measured."""
    entry, used = profile["schemes"][quant], profile["settings"]["threshold"]
    exact = entry["mismatch"].get("exact")
    before = exact["kl"] if exact else None
    after = (entry["mismatch_after_skip"] or entry["mismatch"])["exact"]["kl"] if exact else None
    model = profile.get("model", {}).get("path", "?")
    lines = [
        f"flashrl rollout config written by `flashrl setup` (flashrl {flashrl.__version__}) from "
        f"{source}",
        f"model: {model}; profiled {profile.get('created', '?')} on "
        f"{profile.get('device_name', '?')}",
        f"scheme {quant}; {len(skip) - len(DEFAULT_SKIP)} checkpoint tensor(s) kept in bf16 "
        f"besides the defaults ({', '.join(DEFAULT_SKIP)})",
    ]
    if threshold is None or threshold == used:
        lines.append(
            f"threshold {used:g} (relative output error); exact KL(quant || bf16) per "
            f"position: {fmt(before)} with all layers quantized, {fmt(after)} with this "
            f"skip list"
        )
    else:
        lines.append(
            f"threshold {threshold:g} chosen at setup (the profile used {used:g}): the "
            f"mismatch of this skip list was not measured; re-run `flashrl profile "
            f"--threshold {threshold:g}` to measure it"
        )
    smoothing = entry.get("smoothing")
    if smoothing and smoothing.get("kl") is not None:
        lines.append(
            f"online smoothing (a = {smoothing['alpha']:g}) on top of that skip list: exact KL "
            f"{fmt(smoothing['kl'])}, {'kept' if smoothing['kept'] else 'not kept (no lower)'}"
            + ("; the built-in engine and the vLLM plugin both honour it" if smoothing["kept"]
               else "")
        )  # fmt: skip
    lines += [
        "use: FLASHRL_CONFIG=<this file>, Engine(model, <this file>), "
        "flashrl generate --quant <this file>,",
        "     or flashrl train --rollout.file <this file>",
    ]
    return "\n".join(lines)


def run_setup(
    profile_path: str | Path,
    out: str | Path,
    quant: str | None = None,
    threshold: float | None = None,
) -> RolloutConfig:
    """Read a profile, write the YAML config for one scheme to `out`, and return the config."""
    profile = load_profile(profile_path)
    config, header = build_setup(profile, quant, threshold, source=str(profile_path))
    out = Path(out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: directory {str(out.parent)!r} does not exist")
    config.to_yaml(out, header=header)
    if RolloutConfig.from_yaml(out) != config:  # the file must read back to the same config
        raise RuntimeError(f"{out} does not read back to the config it was written from")
    return config
