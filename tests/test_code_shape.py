"""Size limits of the source (issue 16): no module over 400 lines, no function over 60 lines unless
its docstring says why (it contains "over 60 lines"). Read with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import flashrl

SRC = Path(flashrl.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
SOURCES = sorted(SRC.rglob("*.py"))


def test_no_module_over_400_lines():
    long = {
        str(p.relative_to(SRC)): n
        for p in SOURCES
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"modules over {MAX_FILE_LINES} lines: {long}"


def long_functions(source: str) -> dict[str, int]:
    """Functions longer than the limit whose docstring does not say why, with their lengths."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            why = "over 60 lines" in (ast.get_docstring(node) or "").lower()
            if lines > MAX_FUNCTION_LINES and not why:
                found[f"{node.name}:{node.lineno}"] = lines
    return found


def test_no_function_over_60_lines_without_a_reason():
    long = {
        f"{p.relative_to(SRC)}:{name}": n
        for p in SOURCES
        for name, n in long_functions(p.read_text()).items()
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines, no reason given: {long}"


def test_the_checker_finds_a_long_function_and_accepts_a_reason():
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    assert list(long_functions(f"def f():\n{body}\n")) == ["f:1"]
    reason = '    """Over 60 lines: one table."""\n'
    assert long_functions(f"def f():\n{reason}{body}\n") == {}
