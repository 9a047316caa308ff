"""Command-line flags from dataclass fields: one helper for every `flashrl` subcommand.

`add_fields(parser, cls)` adds one flag per field of a dataclass (``--max-new-tokens`` for
``max_new_tokens``; with ``prefix="algo."`` ``--algo.lr``), with the field's docstring as help and
its default shown; a field that is itself a dataclass gets its fields' flags one dot deeper
(``--rollout.workers.count``). Flags take strings; `build(cls, args)` converts the ones on the
command line to the fields' types (`flashrl.rl.values.coerce`, errors naming the flag) and
constructs the dataclass, the other fields keeping their defaults. A boolean flag
alone means true (``--hf``); with a value it takes any boolean word (``--hf false``). A flag's value
is stored under ``prefix + name`` in the namespace (``args.batch``, ``vars(args)["algo.lr"]``), and
only when it is given.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
from collections.abc import Iterable
from typing import Any, get_type_hints

from flashrl.rl.values import coerce, kinds


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its documentation: the string literal under the field (attribute docstring)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flag(name: str, prefix: str = "") -> str:
    """``--prefix.field-name`` of a field."""
    return f"--{prefix}{name.replace('_', '-')}"


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    prefix: str = "",
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    help: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add a flag for every field of dataclass `cls` (or those named in `only`, minus `skip`);
    `help` overrides a field's documentation, `defaults` the default it shows (for a command
    that fills in its own)."""
    hints = get_type_hints(cls)
    docs = {**field_docs(cls), **(help or {})}
    wanted = None if only is None else set(only)
    for f in dataclasses.fields(cls):
        if (wanted is not None and f.name not in wanted) or f.name in skip:
            continue
        if dataclasses.is_dataclass(hints[f.name]):  # a nested group
            add_fields(parser, hints[f.name], prefix=f"{prefix}{f.name}.")
            continue
        default = (defaults or {}).get(f.name, _default(f))
        text = docs.get(f.name, "")
        if default is not dataclasses.MISSING and default != "" and "(default:" not in text:
            text += f" (default: {_show(default)})"
        is_bool = kinds(hints[f.name])[0] is bool
        required = default is dataclasses.MISSING
        parser.add_argument(
            flag(f.name, prefix),
            dest=prefix + f.name,
            required=required,
            default=argparse.SUPPRESS,
            help=text.strip().replace("%", "%%") or None,
            metavar=_metavar(hints[f.name]),
            nargs="?" if is_bool else None,
            const="true" if is_bool else None,
        )


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "none"
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _metavar(hint: Any) -> str:
    names = {bool: "BOOL", int: "INT", float: "NUM", str: "STR"}
    out = []
    for kind in kinds(hint):
        if getattr(kind, "__origin__", None) is tuple:
            out.append("A,B" if getattr(kind, "__args__", ())[:1] == (str,) else "VALUE")
        else:
            out.append(names.get(kind, "VALUE"))
    return "|".join(out)


def values(cls: type, args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The typed values of the `cls` fields given on the command line (errors name the flag).
    A field's ``metadata["words"]`` maps extra words to values (``{"auto": None}``)."""
    hints, given = get_type_hints(cls), vars(args)
    out = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if key not in given:
            continue
        value, words = given[key], f.metadata.get("words", {})
        if isinstance(value, str) and value.strip().lower() in words:
            out[f.name] = words[value.strip().lower()]
        else:
            out[f.name] = coerce(flag(key), hints[f.name], value)
    return out


def build(cls: type, args: argparse.Namespace, prefix: str = "", **extra: Any) -> Any:
    """`cls` built from its flags given on the command line (other fields keep their defaults)
    and `extra` keyword arguments."""
    return cls(**{**values(cls, args, prefix), **extra})
