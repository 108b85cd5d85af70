"""The package layout keeps its promises (DESIGN.md): no import cycles between engine's modules
(function-level imports included), no module found through ``sys.modules`` or ``__import__``,
files of a few hundred lines, and every public error reachable as ``engine.<Name>`` from the
one leaf module ``engine.errors``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "engine"
MAX_LINES = 550


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Line numbers under ``if TYPE_CHECKING:`` (annotations only: not a runtime edge)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if hasattr(sub, "lineno"):
                    lines.add(sub.lineno)
    return lines


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """engine modules ``name`` imports at run time (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = parts[: len(parts) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = _graph()
    # a package face (engine.x/__init__) re-exports its modules; those modules importing each
    # other is what must be acyclic, so faces are left out of the cycle search
    faces = {name for name, path in _modules().items() if path.name == "__init__.py"}
    inner = {m: {d for d in deps if d not in faces} for m, deps in graph.items() if m not in faces}
    assert _cycles(inner) == []


def test_no_hidden_module_lookups() -> None:
    offenders = []
    for name, path in _modules().items():
        text = path.read_text()
        if "sys.modules" in text or "__import__(" in text:
            offenders.append(name)
    assert offenders == []


@pytest.mark.parametrize("name", sorted(_modules()))
def test_files_stay_small(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concept"


def test_every_public_error_is_reachable_from_engine() -> None:
    import engine
    import engine.errors

    for name in engine.errors.__all__:
        assert getattr(engine, name) is getattr(engine.errors, name)
        assert issubclass(getattr(engine, name), Exception)
    from engine.arena import ArenaError, SlotError
    from engine.schedule import ScheduleError

    assert ArenaError is engine.ArenaError and SlotError is engine.SlotError
    assert ScheduleError is engine.ScheduleError
