"""Checks every `flashrl` subcommand runs before its work (docs/reliability.md, "Command line"), and
strict JSON for what the commands write."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashrl.core.device import resolve_device
from flashrl.core.env import from_env
from flashrl.errors import ConfigError, UnsupportedError
from flashrl.quant.kernels import get_mode

DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when available)"


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse a device this machine cannot run (ConfigError for a bad name, UnsupportedError for
    CUDA without CUDA) before a model is loaded; the message names `flag`."""
    if device is None:
        return
    try:
        resolve_device(device)
    except (ConfigError, UnsupportedError) as err:
        if isinstance(err, ConfigError) or "cpu or cuda" in str(err):
            raise ConfigError(
                f"{flag} {device!r} is invalid; allowed: cpu, cuda or cuda:N"
            ) from None
        detail = str(err).removeprefix(f"device={device!r}: ")
        raise UnsupportedError(f"{flag} {device}: {detail}; use {flag} cpu") from None


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except OSError:
        return False


def check_output(
    flag: str, out: str | None, inputs: Mapping[str, str | None] | None = None
) -> None:
    """Refuse an output path that the write at the end would fail on or that would destroy an
    input: an existing directory, a missing or read-only parent directory, or an input file."""
    if not out:
        return
    path = Path(out).expanduser()
    if path.is_dir():
        raise ConfigError(f"{flag} {out}: is a directory; give a file path")
    for input_flag, value in (inputs or {}).items():
        if value and _same_file(path, Path(value).expanduser()):
            raise ConfigError(
                f"{flag} {out}: is the same file as {input_flag} {value}; writing it "
                f"would destroy the input: choose another {flag}"
            )
    parent = Path(os.path.realpath(path)).parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {out}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: directory {str(parent)!r} is not writable")


def check_environment() -> None:
    """Validate every FLASHRL_* variable (ConfigError naming it) before the work starts."""
    from_env()
    get_mode()


def preflight(args: argparse.Namespace) -> None:
    """The checks every subcommand gets before its work: the device and the output file."""
    check_device(getattr(args, "device", None))
    if getattr(args, "out", None):
        inputs = {
            f"--{name.replace('_', '-')}": getattr(args, name, None)
            for name in getattr(args, "inputs", ())
        }
        check_output("--out", args.out, inputs)


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: `json.dumps(allow_nan=False)` then
    never writes NaN / Infinity, which are not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text (non-finite numbers as null)."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)
