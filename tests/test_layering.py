"""Import layering of the flashrl package, read from the source with `ast` (nothing is imported).

Layers, bottom to top (a module imports only from lower layers, and from its own package):

    core < quant < model < engine, vllm_backend < correction < rl < profile, verify, bench < cli

`errors`, `fileio`, `utils`, `testing`, `masked` and `calibration_prompts` are utilities: anyone may
import them, and they import only each other. Every import counts, at module level or inside a
function, except those under ``if TYPE_CHECKING:``. A second test checks that the module-level imports between flashrl
modules have no cycle (imports inside functions run later and may close a cycle on purpose).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flashrl

SRC = Path(flashrl.__file__).parent
LAYERS = {
    "core": 0,
    "quant": 2,
    "model": 3,
    "engine": 4,
    "vllm_backend": 4,
    "correction": 5,
    "distributed": 5,
    "rl": 6,
    "profile": 7,
    "verify": 7,
    "bench": 7,
    "tools": 7,
    "cli": 8,
}
UTILITIES = {"flashrl", "errors", "fileio", "utils", "testing", "masked", "calibration_prompts"}
"""`flashrl` is the package root (``__version__``); `masked` holds torch-only masked reductions
(correction and rl); `calibration_prompts` is data."""

ALLOWED_FOR_NOW: set[tuple[str, str]] = set()
"""Known exceptions: none. The last one, `flashrl.correction` re-exporting `rl.loss.ppo_clip_loss`,
is gone (issue 25 item 4: the loss is imported from `flashrl.rl.loss`, where it lives);
`test_allowed_violations_still_exist` makes sure no stale entry stays here."""


def module_name(path: Path) -> str:
    parts = ("flashrl",) + path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def area(module: str) -> str:
    """The layer key of a module: its first name below `flashrl` (``flashrl`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "flashrl"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The flashrl modules an import statement in `module` names (a submodule where a name of
    ``from package import name`` is one, else the package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "flashrl" or a.name.startswith("flashrl.")]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if not MODULES[module].name == "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    if base != "flashrl" and not base.startswith("flashrl."):
        return []
    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return sorted(set(targets))


def imports(module: str) -> list[tuple[str, bool]]:
    """(imported flashrl module, at module level) for every import of `module`, outside
    ``if TYPE_CHECKING:`` blocks."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.extend((target, top) for target in _resolve(module, node))
        inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(MODULES[module].read_text()), True)
    return found


def violation(source: str, target: str) -> str | None:
    """Why `source` may not import `target`, or None when it may."""
    a, b = area(source), area(target)
    if a in UTILITIES:
        return None if b in UTILITIES else f"utility {source} imports {target}"
    if b in UTILITIES or a == b:
        return None
    if LAYERS[b] >= LAYERS[a]:
        return f"{source} ({a}, layer {LAYERS[a]}) imports {target} ({b}, layer {LAYERS[b]})"
    return None


def test_every_module_has_a_layer():
    unknown = sorted({area(m) for m in MODULES} - set(LAYERS) - UTILITIES)
    assert not unknown, f"add these top-level modules to LAYERS or UTILITIES: {unknown}"


def test_imports_only_go_down_the_layers():
    found = set()
    for module in MODULES:
        for target, _ in imports(module):
            reason = violation(module, target)
            if reason is not None and (module, target) not in ALLOWED_FOR_NOW:
                found.add(reason)
    assert not found, "imports against the layering:\n" + "\n".join(sorted(found))


def test_allowed_violations_still_exist():
    """An entry of ALLOWED_FOR_NOW that no longer occurs must go (the set only shrinks)."""
    actual = {(m, t) for m in MODULES for t, _ in imports(m) if violation(m, t)}
    fixed = ALLOWED_FOR_NOW - actual
    assert not fixed, f"fixed, remove from ALLOWED_FOR_NOW: {fixed}"


def test_no_import_cycles_at_module_level():
    graph = {
        m: sorted({t for t, top in imports(m) if top and t in MODULES and t != m}) for m in MODULES
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for module in graph:
        if module not in state and (cycle := walk(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


@pytest.mark.parametrize(
    "source, target, bad",
    [
        ("flashrl.engine.engine", "flashrl.model.decoder", False),
        ("flashrl.model.decoder", "flashrl.engine.kv_cache", True),
        ("flashrl.core.config", "flashrl.quant.schemes", True),
        ("flashrl.engine.engine", "flashrl.vllm_backend.config", True),
        ("flashrl.engine.engine", "flashrl.correction", True),
        ("flashrl.rl.trainer", "flashrl.engine", False),
        ("flashrl.utils", "flashrl.core", True),
        ("flashrl.quant.linear", "flashrl.errors", False),
    ],
)
def test_the_rule(source, target, bad):
    """The rule itself: downward and utility imports pass, upward and sideways ones fail."""
    assert (violation(source, target) is not None) == bad


def test_the_parser_sees_function_level_imports_and_skips_type_checking(tmp_path, monkeypatch):
    code = (
        "from typing import TYPE_CHECKING\nfrom flashrl.core import config\n"
        "if TYPE_CHECKING:\n    from flashrl.engine import Engine\n"
        "def f():\n    from flashrl.rl import trainer\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(code)
    monkeypatch.setitem(MODULES, "flashrl.model.probe", path)
    assert sorted(imports("flashrl.model.probe")) == [
        ("flashrl.core.config", True),
        ("flashrl.rl.trainer", False),
    ]
