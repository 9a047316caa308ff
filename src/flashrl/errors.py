"""flashrl's exception types: every error caused by the user's input or files is one of these.

The CLI prints these (and YAML, safetensors and OS errors on user paths) as one line naming the
file or argument and what is allowed, with exit code 2. Anything else is a bug in flashrl and
keeps its traceback. The types that describe bad values also derive from `ValueError`, so code
written against the earlier ``ValueError`` contract keeps working.
"""

from __future__ import annotations


class FlashRLError(Exception):
    """Base of every error flashrl raises on purpose (bad input, damaged file, unsupported setting)."""


class ConfigError(FlashRLError, ValueError):
    """A configuration value, option, environment variable or config file is invalid."""


class InputError(FlashRLError, ValueError):
    """A runtime input is invalid: prompts, token ids, sampling parameters, tensors."""


class WeightError(InputError):
    """A weight update or checkpoint tensor was refused (unknown name, shape, dtype, NaN/Inf, ...);
    the target's previous weights are unchanged."""


class CheckpointError(FlashRLError, ValueError):
    """A checkpoint, run directory or state file is missing, damaged or does not match the run."""


class UnsupportedError(FlashRLError, ValueError):
    """The request is valid but cannot run here (device, kernel, library version)."""


__all__ = [
    "CheckpointError",
    "ConfigError",
    "FlashRLError",
    "InputError",
    "UnsupportedError",
    "WeightError",
]
