"""A static index of the project's source for scripts/config_walk.py: its modules, what their names and imports
resolve to, the classes their annotations name, and the layers of pyproject's import-linter contract. Stdlib only
(``ast``), nothing imported from the project."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Module:
    """One parsed project module: its functions, classes and the names its imports bind."""

    name: str
    rel: str
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imports: dict[str, str] = field(default_factory=dict)
    """local name -> dotted target (``pkg.mod`` or ``pkg.mod.attr``)."""


@dataclass(frozen=True)
class Target:
    """A resolved callee: a function, a method (``cls`` set) or a class (``fn`` its ``__init__``/``__post_init__``)."""

    module: Module
    qualname: str
    fn: ast.FunctionDef | None
    cls: ast.ClassDef | None = None

def import_linter_layers(pyproject: Path) -> tuple[list[str], list[str]]:
    """import-linter's ``root_packages`` and its layers contract's ``layers`` (highest first), read off
    pyproject.toml's one-line lists (the project supports Python 3.10, which has no ``tomllib``)."""
    text = pyproject.read_text(encoding="utf-8")
    lists = {key: ast.literal_eval(value) for key, value in re.findall(r"^(root_packages|layers)\s*=\s*(\[.*\])\s*$",
                                                                         text, flags=re.M)}
    return lists["root_packages"], lists["layers"]


def unquoted(annotation: ast.expr | None) -> ast.expr | None:
    """An annotation, parsed when written as a string."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            return ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    return annotation


class Project:
    """The project's modules, its layers and the class and name resolution the walk needs."""

    def __init__(self, root: Path, config_class: str) -> None:
        self.root = root
        packages, layers = import_linter_layers(root / "pyproject.toml")
        self.layer = {pkg.strip(): len(layers) - i for i, group in enumerate(layers) for pkg in group.split("|")}
        self.modules: dict[str, Module] = {}
        for pkg in packages:
            for path in sorted((root / pkg).rglob("*.py")):
                self._add(path)
        self.config_classes = self._config_classes(config_class)

    def _add(self, path: Path) -> None:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        mod = Module(name, path.relative_to(self.root).as_posix())
        package = parts if path.name == "__init__.py" else parts[:-1]
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                mod.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node
        for node in ast.walk(tree):  # imports at any depth (a deferred import binds its name in that function)
            if isinstance(node, ast.Import):
                for a in node.names:
                    mod.imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package[: len(package) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in node.names:
                    mod.imports[a.asname or a.name] = f"{base}.{a.name}"
        self.modules[name] = mod

    def lookup(self, dotted: str, depth: int = 0) -> tuple[Module, str] | Module | None:
        """A dotted name as (module, top-level name defined there), a module, or None (not the project's)."""
        if dotted in self.modules:
            return self.modules[dotted]
        mod_name, _, attr = dotted.rpartition(".")
        mod = self.modules.get(mod_name)
        if mod is None or depth > 10:
            return None
        if attr in mod.functions or attr in mod.classes:
            return mod, attr
        if attr in mod.imports:  # a re-export
            return self.lookup(mod.imports[attr], depth + 1)
        return None

    def name_in(self, mod: Module, name: str) -> tuple[Module, str] | Module | None:
        """What a bare name means in a module."""
        return self.lookup(mod.imports[name]) if name in mod.imports else self.lookup(f"{mod.name}.{name}")

    def class_of(self, mod: Module, annotation: ast.expr | None) -> tuple[str, str] | None:
        """The project class an annotation names (``Bench``, ``Bench | None``, ``"Bench"``, ``list[Bench]``), or
        None."""
        annotation = unquoted(annotation)
        if isinstance(annotation, ast.BinOp):
            return self.class_of(mod, annotation.left) or self.class_of(mod, annotation.right)
        if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name) and \
                annotation.value.id in ("list", "tuple", "Sequence", "Optional"):  # the elements' class
            inner = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
            return next((c for e in inner if (c := self.class_of(mod, e)) is not None), None)
        if isinstance(annotation, ast.Name):
            found = self.name_in(mod, annotation.id)
            if isinstance(found, tuple) and found[1] in found[0].classes:
                return found[0].name, found[1]
        return None

    def classes_named(self, mod: Module, annotation: ast.expr | None) -> list[tuple[str, str] | None]:
        """The project classes a return annotation names, one per tuple element (``tuple[Bench, list[str]]``)."""
        annotation = unquoted(annotation)
        if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name) and \
                annotation.value.id == "tuple" and isinstance(annotation.slice, ast.Tuple):
            return [self.class_of(mod, e) for e in annotation.slice.elts]
        return [self.class_of(mod, annotation)]

    def fields(self, cls: tuple[str, str]) -> dict[str, tuple[str, str] | None]:
        """A class's annotated fields (class level and ``self.x: T`` in methods) -> the project class they hold."""
        mod = self.modules[cls[0]]
        out: dict[str, tuple[str, str] | None] = {}
        for node in ast.walk(mod.classes[cls[1]]):
            if isinstance(node, ast.AnnAssign):
                t = node.target
                if isinstance(t, ast.Name):
                    out[t.id] = self.class_of(mod, node.annotation)
                elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out[t.attr] = self.class_of(mod, node.annotation)
        return out

    def _config_classes(self, config_class: str) -> set[tuple[str, str]]:
        """The config's class (by name) and, to a fixpoint, every class with a field that holds one of these."""
        found = {(m.name, config_class) for m in self.modules.values() if config_class in m.classes}
        classes = [(m.name, c) for m in self.modules.values() for c in m.classes]
        while grown := {c for c in classes if c not in found and set(self.fields(c).values()) & found}:
            found |= grown
        return found

    def method(self, cls: tuple[str, str], name: str, depth: int = 0) -> Target | None:
        """A class's method, searched in its project base classes too."""
        mod = self.modules[cls[0]]
        node = mod.classes[cls[1]]
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == name:
                return Target(mod, f"{cls[1]}.{name}", item, node)
        for base in node.bases:
            b = self.class_of(mod, base)
            if b is not None and depth < 10 and (found := self.method(b, name, depth + 1)) is not None:
                return found
        return None
