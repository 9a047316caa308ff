"""Typed config values from command-line strings and YAML: one conversion for `flashrl train`'s
config and every other subcommand's flags.

`coerce(name, hint, value)` turns ``"10"``, ``"true"``, ``"none"`` or a YAML value into the type of
a dataclass field (``int``, ``float | None``, ``bool``, ``tuple[str, ...]``, ``str | float``...).
Strings are parsed; YAML values must already have the type, except that an int is a valid float, a
number a valid string and a list a valid tuple. Errors are `ConfigError`s naming the source (a
file), the field, the value and the expected type.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

from flashrl.core.env import FALSE_WORDS, TRUE_WORDS
from flashrl.errors import ConfigError

NONE_WORDS = ("none", "null", "")
"""Strings that mean None for an optional field (any case)."""
_KINDS = {
    bool: ("a boolean", "true or false"),
    int: ("an integer",) * 2,
    float: ("a number",) * 2,
    str: ("a string",) * 2,
    tuple: ("a list",) * 2,
}


def is_optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint) and _is_union(hint)


def kinds(hint: Any) -> list[Any]:
    """The non-None types of a type hint: ``int | None`` -> [int]; ``str | float`` -> [str,
    float]."""
    if _is_union(hint):
        return [t for t in typing.get_args(hint) if t is not type(None)]
    return [hint]


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _base(kind: Any) -> Any:
    return typing.get_origin(kind) or kind


class _NaNError(ValueError):
    """A float field given NaN (named in the message: it parses, but is refused)."""


def _parse_bool(text: str) -> bool | None:
    low = text.strip().lower()
    return True if low in TRUE_WORDS else False if low in FALSE_WORDS else None


def _one(kind: Any, value: Any) -> Any:
    """`value` as `kind`, or raise ValueError."""
    base = _base(kind)
    if base is bool:
        if isinstance(value, bool):
            return value
        parsed = _parse_bool(value) if isinstance(value, str) else None
        if parsed is None:
            raise ValueError
        return parsed
    if isinstance(value, bool):
        raise ValueError  # a YAML true is not a number or a string
    if base is int:
        if isinstance(value, str):
            return int(value)
        if isinstance(value, int):
            return value
        raise ValueError
    if base is float:
        if not isinstance(value, (str, int, float)):
            raise ValueError
        number = float(value)
        if math.isnan(number):
            raise _NaNError
        return number
    if base is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)):
            return str(value)  # e.g. `rejection_thresholds: 0.01`
        raise ValueError
    if base is tuple:
        if isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        if isinstance(value, (list, tuple)):
            return tuple(value)
        raise ValueError
    raise TypeError(f"unsupported field type {kind!r}")


def coerce(name: str, hint: Any, value: Any, source: str | None = None) -> Any:
    """`value` (a command-line string or a YAML value) converted to the type `hint`; a
    `ConfigError` naming `source`, `name`, the value and the expected type otherwise."""
    prefix = f"{source}: " if source else ""
    options = kinds(hint)
    optional = is_optional(hint)
    none_word = isinstance(value, str) and value.strip().lower() in NONE_WORDS
    if value is None or (optional and none_word):
        if not optional:
            expected = _KINDS[_base(options[0])][1]
            raise ConfigError(f"{prefix}{name} cannot be empty; expected {expected}")
        return None
    if len(options) > 1:  # a union such as `str | float`: a value of one of them passes through
        for kind in options:
            if isinstance(value, _base(kind)) and not isinstance(value, bool):
                return value
    detail = ""
    for kind in options:
        try:
            return _one(kind, value)
        except _NaNError:
            detail = " (NaN)"
        except ValueError:
            pass
    what, expected = _KINDS[_base(options[0])]
    expected += " or none" if optional else ""
    raise ConfigError(f"{prefix}{name}={value!r} is not {what}{detail}; expected {expected}")
