"""Config fields that say which values they take, checked by one function.

A field's rule is written where the field is, beside its docstring (the field's documentation and
its flag's help):

    payload: str = choice("stream", PAYLOADS)
    threads: int = integer(1, note="torch threads per worker")
    lr: float = number(1e-4, above=0, at_most=1.0)
    quant: str = setting("bf16", check=scheme_name)  # any function: checks, may normalize

`check_fields(config, prefix)`, called from a config's ``__post_init__`` (`TrainConfig.validate` for
its groups), runs the rules in field order; a float without a rule must still be finite (``inf``
parses as a float but would fail much later, naming a tensor). Errors are `ConfigError`s naming
``prefix + field``, the value and what is allowed:

    rollout.workers.payload='xor' is invalid; allowed: stream, codes, delta
    run.keep_last=0 is invalid; allowed: an integer >= 1 (none: keep every checkpoint)
    algo.lr=inf is not a finite number; allowed: a number > 0 and <= 1
    rollout.workers.cpus=-1 is out of range (negative); allowed: a number >= 0

Other readers keep their facts in the same metadata: ``resume_free`` (`flashrl.rl.config`),
``words`` (`flashrl.tools.args`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import MISSING, field, fields
from typing import Any

from flashrl.errors import ConfigError

_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
Rule = Callable[[str, Any], Any]
"""(the field's name with its prefix, the value) -> the value to keep; raises a `ConfigError`."""


def setting(
    default: Any = MISSING, *, check: Callable[[Any], Any] | None = None, **meta: Any
) -> Any:
    """A field with metadata `meta`; `check(value)` (optional) returns the value to keep or raises
    a `ConfigError` naming the field itself."""
    return _field(default, None if check is None else lambda name, value: check(value), meta)


def choice(default: str | None, allowed: Any, **meta: Any) -> Any:
    """One of `allowed`: a tuple, a registry (its keys) or a function returning the names, read at
    each check, so that a name registered later counts. None too when the default is None."""

    def rule(name: str, value: Any) -> Any:
        names = tuple(allowed() if callable(allowed) else allowed)
        if (isinstance(value, str) and value in names) or (value is None and default is None):
            return value
        raise ConfigError(f"{name}={value!r} is invalid; allowed: {', '.join(names)}")

    return _field(default, rule, meta)


def integer(default: int | None, least: int = 1, note: str = "", **meta: Any) -> Any:
    """An int >= `least` (a bool is not one); None too when the default is None. `note` says what a
    value means, after the bound."""
    allowed = f"an integer >= {least}" + (f" ({note})" if note else "")

    def rule(name: str, value: Any) -> Any:
        if value is None and default is None:
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return value
        raise ConfigError(f"{name}={value!r} is invalid; allowed: {allowed}")

    return _field(default, rule, meta)


def number(
    default: float | None,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    unit: str = "a number",
    note: str = "",
    **meta: Any,
) -> Any:
    """A finite int or float within the bounds given (a bool is not one); None too when the default
    is None. `unit` names what the number counts, `note` what a value means."""
    given = {">": above, ">=": at_least, "<": below, "<=": at_most}
    bounds = [(op, bound) for op, bound in given.items() if bound is not None]
    limits = " and ".join(f"{op} {bound:g}" for op, bound in bounds)
    allowed = f"{unit} {limits}".strip() + (f" ({note})" if note else "")

    def rule(name: str, value: Any) -> Any:
        if value is None and default is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            why = "is not a number"
        elif not math.isfinite(value):
            why = "is not a finite number"
        elif not all(_COMPARE[op](value, bound) for op, bound in bounds):
            negative = value < 0 and 0 in (above, at_least)
            why = "is out of range" + (" (negative)" if negative else "")
        else:
            return value
        raise ConfigError(f"{name}={value!r} {why}; allowed: {allowed}")

    return _field(default, rule, meta)


def check_fields(
    config: Any, prefix: str = "", of: type | None = None, skip: Iterable[str] = ()
) -> None:
    """Run the rule of every field of `config` (those declared by class `of`, when given; none of
    `skip`), in order; a value a rule normalizes is stored back (frozen dataclasses too)."""
    for f in fields(of or config):
        if f.name in skip:
            continue
        value, rule = getattr(config, f.name), f.metadata.get("check")
        if rule is not None:
            kept = rule(prefix + f.name, value)
            if kept is not value:
                object.__setattr__(config, f.name, kept)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"{prefix}{f.name}={value!r} is not a finite number; allowed: a finite number"
            )


def _field(default: Any, rule: Rule | None, meta: dict[str, Any]) -> Any:
    if rule is not None:
        meta = {**meta, "check": rule}
    return field(default=default, metadata=meta)
