"""The code's shape, checked on its syntax trees: no import cycles, few imports inside function bodies.

Scans every ``.py`` file of ``SOURCE_DIRS`` (not tests, ``.venv`` or ``outputs``). A cycle counts every import
statement at any depth (inside functions, under ``TYPE_CHECKING``, in ``try``), since a cycle is fixed by moving code,
not by deferring an import; failures name each cycle as ``a -> b -> a`` with the importing lines. Imports inside
function bodies are kept for optional or heavy dependencies only, each with a ``# reason`` comment. ``lint-imports``
checks the same cycles per package (``acyclic_siblings`` in pyproject.toml); this test names them line by line.
"""
from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("compute", "data_gen", "predictors", "evaluation", "decoding", "rendering", "main_job", "benchmark",
               "runtimes", "pipelines", "benchmarks", "scripts")
SKIPPED_PARTS = {".venv", "outputs", "tests", "__pycache__"}
MAX_DEFERRED_IMPORTS = 40


@dataclass(frozen=True)
class SourceModule:
    """One parsed source file and its dotted module name."""

    path: Path
    name: str
    text: str
    tree: ast.Module

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


@functools.cache
def source_modules() -> tuple[SourceModule, ...]:
    """Every non-test source file of the project, parsed."""
    out = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if SKIPPED_PARTS & set(path.relative_to(ROOT).parts):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            text = path.read_text(encoding="utf-8")
            out.append(SourceModule(path, ".".join(parts), text, ast.parse(text, filename=str(path))))
    return tuple(out)


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method of a tree, nested ones included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def deferred_imports(module: SourceModule) -> list[ast.Import | ast.ImportFrom]:
    """Import statements inside function bodies (each counted once, however deeply nested)."""
    found: dict[int, ast.Import | ast.ImportFrom] = {}
    for fn in functions(module.tree):
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found[id(node)] = node
    return sorted(found.values(), key=lambda n: n.lineno)


def imported_modules(module: SourceModule, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The project modules an import statement loads (empty for third-party imports)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = []
    for target in targets:
        while target and target not in known:  # `import a.b.c` of a non-module attribute path: its module
            target = target.rpartition(".")[0]
        if target and target not in out:
            out.append(target)
    return out


def import_graph() -> dict[str, dict[str, list[str]]]:
    """module -> imported project module -> the ``file:line`` of each import statement."""
    mods = source_modules()
    known = {m.name for m in mods}
    graph: dict[str, dict[str, list[str]]] = {m.name: {} for m in mods}
    for m in mods:
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_modules(m, node, known):
                    if target != m.name:
                        graph[m.name].setdefault(target, []).append(f"{m.rel}:{node.lineno}")
    return graph


def strongly_connected(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (an import cycle each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def a_cycle(graph: dict[str, dict[str, list[str]]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, as the list of modules (first repeated last)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def test_no_import_cycles():
    graph = import_graph()
    report = []
    for component in strongly_connected(graph):
        cycle = a_cycle(graph, component)
        where = "; ".join(f"{a} -> {b} at {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:]))
        report.append(f"{' -> '.join(cycle)} (component: {', '.join(component)}): {where}")
    assert not report, "import cycles among the project's modules:\n" + "\n".join(report)


def test_few_imports_inside_functions():
    found = [f"{m.rel}:{node.lineno}: {m.text.splitlines()[node.lineno - 1].strip()}"
             for m in source_modules() for node in deferred_imports(m)]
    print(f"{len(found)} imports inside function bodies:\n" + "\n".join(found))
    assert len(found) <= MAX_DEFERRED_IMPORTS, (
        f"{len(found)} imports inside function bodies (at most {MAX_DEFERRED_IMPORTS}: optional or heavy dependencies "
        "only, each with a `# reason` comment):\n" + "\n".join(found)
    )


def test_the_checks_see_what_they_check():
    """The scanner resolves relative and submodule imports, finds a planted cycle, and counts nested functions."""
    def parsed(name: str, text: str, package: bool = False) -> SourceModule:
        path = ROOT / (name.replace(".", "/") + ("/__init__.py" if package else ".py"))
        return SourceModule(path, name, text, ast.parse(text))

    a = parsed("pkg.a", "from . import b\nfrom .b import thing\nimport pkg.sub.c\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    imports = [n for n in ast.walk(a.tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [imported_modules(a, n, known) for n in imports] == [["pkg.b"], ["pkg.b"], ["pkg.sub.c"]]
    init = parsed("pkg.sub", "from . import c\nfrom .. import a\nfrom pkg import missing\n", package=True)
    imports = [n for n in ast.walk(init.tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [imported_modules(init, n, known) for n in imports] == [["pkg.sub.c"], ["pkg.a"], ["pkg"]]
    graph = {"x": {"y": ["x.py:1"]}, "y": {"z": ["y.py:3"]}, "z": {"x": ["z.py:9"]}, "w": {"x": ["w.py:2"]}}
    (component,) = strongly_connected(graph)
    assert component == ["x", "y", "z"] and a_cycle(graph, component) == ["x", "y", "z", "x"]
    scanned = {m.rel.split("/")[0] for m in source_modules()}
    assert {"benchmarks", "scripts", "pipelines"} <= scanned, scanned
    nested = parsed("pkg.n", "def f():\n    def g():\n        import os\n    import sys\n")
    assert [n.lineno for n in deferred_imports(nested)] == [3, 4]
