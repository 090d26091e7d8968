"""Walk the benchmark's config through the code from its entry point, statically, and count the walk's stops.

How far a reader who follows the ``BenchmarkConfig`` object from the benchmark's entry point has to travel through
the code, and how often back up a layer. Stdlib
only (``ast``; the index of the source in ``scripts/static_index.py``), deterministic, nothing imported from the
project::

    python scripts/config_walk.py [--root DIR] [--trace] [--reads leaf|follow] [--repeats] [--back]

The walk is a depth-first walk of the static call graph from the entry point's ``main()``
(``pipelines/benchmark.py``, or ``pipelines/benchmark.py`` where the benchmark was one module), in
evaluation order (a call's callee and arguments before the call, statements in source order), that follows the config:

- *the config*: ``main``'s variable assigned from a call given the ``BenchmarkConfig`` class (that call is the first
  step); a parameter bound to an argument that is the config; a name assigned the config, ``replace(cfg, ...)``, a
  project object constructed with it, or a project function's result whose return annotation names a config class
  (element-wise for a returned tuple); a project class nested in it (``cfg.models``, the elements of ``cfg.prompts``).
  A *carrier*, a project class with a field annotated with a config class (``run.cfg: BenchmarkConfig``), holds the
  config in those fields only: ``run.cfg`` is the config, ``run.draft`` (a model) is not; calling its methods passes
  the config;
- *a value read off it*: an attribute of the config that is not a project class (``cfg.max_new_tokens``), and what
  operators, non-project callables and loops make of it (``Path(cfg.out_dir)``);
- a *step* is a call of a project function, method or class given the config or a value read off it (as an argument
  or as the receiver). Given the config, the walk goes into the callee's body; given values read off it only, the
  callee is a step where the value lands, not walked into. A depth-first walk visits each callee once: a callee
  called again is not a step again. A lambda's parameters are taken as the config (a row runner is called with the
  bench), its defaulted ones as what their default is; a nested function is read where it stands;
- the *trail* is the files of the steps in order; a *stop* is a visit to a file (consecutive steps in one file are one
  stop); a *climb* is a stop in a higher layer than the stop before (the layers of pyproject's import-linter
  contract: ``compute < data_gen < predictors < evaluation | decoding < pipelines``); a *return* is a stop in a file
  visited before (so stops = files + returns).

Prints stops, steps (calls), files, climbs, returns and the stops per file as JSON (``--trace``: every step and stop).
``Rules`` holds the choices above and alternatives, to compare definitions: ``--reads follow`` walks into a callee
given a value read off the config too; ``--repeats`` makes every call a step; ``--back`` makes the walk's way back
to the caller's file (to take the caller's next step) a stop.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from static_index import Module, Project, Target  # scripts/static_index.py (this script's folder is on sys.path)

CONFIG_CLASS = "BenchmarkConfig"
ENTRY_FILES = ("pipelines/benchmark.py", "pipelines/benchmark.py")
CONFIG = "config"
"""The kind of a value that is the config (with ``Rules.reads == "follow"``, also a value read from it)."""
READ = "read"
"""The kind of a value read from the config when ``Rules.reads == "leaf"``."""


@dataclass(frozen=True)
class Kind:
    """What a name holds: ``CONFIG`` (the config), ``READ`` (a value read off it) or ``"carrier"`` (see above)."""

    what: str
    cls: tuple[str, str] | None = None
    """(module, class name) when known: resolves methods and typed attributes."""


@dataclass(frozen=True)
class Rules:
    """The walk's choices: whether values read from the config carry it, whether a callee called again is a step."""

    reads: str = "leaf"
    """``leaf``: a call given a value read off the config is a step, not walked into (unless it gets the config too);
    ``follow``: such a value is walked like the config."""
    repeats: bool = False
    """Whether a call of a callee already stepped into is a step again (a depth-first walk visits each once)."""
    back: bool = False
    """Whether the walk's return to the caller's file (to take the caller's next step) is a stop."""


@dataclass
class Scope:
    """A function being walked: its module and class, the names that carry the config and the names' classes."""

    module: Module
    cls: tuple[str, str] | None
    carried: dict[str, Kind]
    types: dict[str, tuple[str, str]]

    def inner(self) -> Scope:
        """A nested scope (lambda, comprehension, nested function) that sees this one's names."""
        return Scope(self.module, self.cls, dict(self.carried), dict(self.types))


class Walk:
    """The depth-first walk: the steps in order (``steps``) and the files they pass through (``trail``)."""

    def __init__(self, project: Project, rules: Rules) -> None:
        self.p = project
        self.rules = rules
        self.read = Kind(CONFIG if rules.reads == "follow" else READ)
        self.steps: list[tuple[str, str]] = []
        self.trail: list[str] = []
        self.expanded: set[tuple[str, str]] = set()
        self.stepped: set[tuple[str, str]] = set()
        self.config_names = {c for c in project.config_classes if c[1] == CONFIG_CLASS}

    def is_config_class(self, found: tuple[Module, str] | Module | None) -> bool:
        """Whether a resolved name is the config's class itself."""
        return isinstance(found, tuple) and (found[0].name, found[1]) in self.config_names

    def kind_of_class(self, cls: tuple[str, str] | None) -> Kind | None:
        """The kind of an instance of a class: the config (``BenchmarkConfig``), a carrier, or None."""
        if cls is None or cls not in self.p.config_classes:
            return None
        return Kind(CONFIG if cls in self.config_names else "carrier", cls)

    def element(self, k: Kind | None) -> Kind | None:
        """What the loop variable over an iterable of kind ``k`` carries: a part of the config, or a read."""
        if k is None or k.what not in (CONFIG, READ):
            return None
        return Kind(CONFIG, k.cls) if k.what == CONFIG and k.cls is not None else self.read

    def carries(self, e: ast.expr | None, s: Scope) -> Kind | None:
        """Whether an expression carries the config, and how (see the module's docstring)."""
        if e is None:
            return None
        if isinstance(e, ast.Name):
            if e.id in s.carried:
                return s.carried[e.id]
            found = self.p.name_in(s.module, e.id)
            return Kind(CONFIG) if self.is_config_class(found) else None
        if isinstance(e, ast.Attribute):
            base = self.carries(e.value, s)
            if base is None:
                return None
            held = self.p.fields(base.cls).get(e.attr) if base.cls else None
            if held in self.p.config_classes:
                return self.kind_of_class(held)
            if base.what == CONFIG and held is not None:
                return Kind(CONFIG, held)  # a part of the config: a project class nested in it (``cfg.models``)
            return Kind(self.read.what, held) if base.what in (CONFIG, READ) else None
        if isinstance(e, ast.Subscript):
            return self.element(self.carries(e.value, s))
        if isinstance(e, ast.Call):
            return self.call_carries(e, s)
        if isinstance(e, ast.Lambda):
            return None
        if isinstance(e, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            inner = [g.iter for g in e.generators]
            return self.read if any(self.carries(x, s) for x in inner) else None
        for child in ast.iter_child_nodes(e):  # operators, containers, f-strings: what an operand carries
            if isinstance(child, ast.expr) and (k := self.carries(child, s)) is not None:
                if isinstance(e, ast.Tuple | ast.List | ast.Starred | ast.BoolOp | ast.IfExp):
                    return k
                return self.read
        return None

    def call_carries(self, call: ast.Call, s: Scope, element: int | None = None) -> Kind | None:
        """What a call's result carries (element ``element`` of a returned tuple when given)."""
        args = [*call.args, *(k.value for k in call.keywords)]
        carried = [k for a in args if (k := self.carries(a, s)) is not None]
        if isinstance(call.func, ast.Name) and call.func.id == "replace" and call.args:
            return self.carries(call.args[0], s)
        if any(isinstance(a, ast.Name) and a.id not in s.carried and
               self.is_config_class(self.p.name_in(s.module, a.id)) for a in call.args):
            return Kind(CONFIG, next(iter(sorted(self.config_names))))  # the config built from its class
        target = self.resolve(call.func, s)
        if target is None:
            receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
            rk = self.carries(receiver, s)
            read = any(k.what in (CONFIG, READ) for k in carried) or (rk is not None and rk.what in (CONFIG, READ))
            return self.read if read else None
        if target.fn is None or target.fn.name in ("__init__", "__post_init__"):  # a class: what it constructs
            cls = (target.module.name, target.qualname)
            if self.kind_of_class(cls) is not None or not carried:
                return self.kind_of_class(cls)
            whole = any(k.what != READ for k in carried)  # a new object built with the config, or with reads off it
            return Kind(CONFIG, cls) if whole else Kind(READ, cls)
        named = self.p.classes_named(target.module, target.fn.returns)
        if element is None:
            return self.kind_of_class(named[0]) if len(named) == 1 else None
        return self.kind_of_class(named[element]) if element < len(named) else None

    def resolve(self, func: ast.expr, s: Scope) -> Target | None:
        """The project function, method or class a call's callee names, or None."""
        if isinstance(func, ast.Name):
            if func.id in s.carried or func.id in s.types:
                return None
            return self.target_of(self.p.name_in(s.module, func.id))
        if not isinstance(func, ast.Attribute):
            return None
        v = func.value
        if isinstance(v, ast.Name) and v.id == "self" and s.cls is not None:
            return self.p.method(s.cls, func.attr)
        cls = self.class_of_expr(v, s)
        if cls is not None:
            return self.p.method(cls, func.attr)
        if isinstance(v, ast.Name) and v.id not in s.carried:
            found = self.p.name_in(s.module, v.id)
            if isinstance(found, Module):
                return self.target_of(self.p.name_in(found, func.attr))
            if isinstance(found, tuple) and found[1] in found[0].classes:  # a classmethod or staticmethod
                return self.p.method((found[0].name, found[1]), func.attr)
        return None

    def target_of(self, found: tuple[Module, str] | Module | None) -> Target | None:
        if not isinstance(found, tuple):
            return None
        mod, name = found
        if name not in mod.classes:
            return Target(mod, name, mod.functions[name])
        init = self.p.method((mod.name, name), "__init__") or self.p.method((mod.name, name), "__post_init__")
        return Target(mod, name, init.fn if init else None, mod.classes[name])  # a class: its __init__ or checks

    def class_of_expr(self, e: ast.expr, s: Scope) -> tuple[str, str] | None:
        """The project class of an expression's value where the walk knows it."""
        if isinstance(e, ast.Name):
            k = s.carried.get(e.id)
            return k.cls if k is not None and k.cls is not None else s.types.get(e.id)
        if isinstance(e, ast.Attribute):
            base = self.class_of_expr(e.value, s)
            return self.p.fields(base).get(e.attr) if base is not None else None
        if isinstance(e, ast.Call):
            k = self.call_carries(e, s)
            return k.cls if k is not None else None
        return None

    def go(self, rel: str) -> None:
        """The walk moves to a file (a new stop unless it is already there)."""
        if not self.trail or self.trail[-1] != rel:
            self.trail.append(rel)

    def step(self, call: ast.Call, s: Scope) -> None:
        """A call: a step into its callee when the project's and its arguments or receiver carry the config."""
        target = self.resolve(call.func, s)
        if target is None:
            return
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        self_kind = self.carries(receiver, s) if target.cls is not None and target.fn is not None and \
            target.qualname.count(".") else None
        bound = self.bind(target, call, s)
        constructor = target.qualname == (target.cls.name if target.cls is not None else None)
        args = [*call.args, *(k.value for k in call.keywords)]
        if not bound and self_kind is None and not (constructor and any(self.carries(a, s) for a in args)):
            return
        key = (target.module.name, target.qualname)
        if not self.rules.repeats and key in self.stepped:
            return
        self.stepped.add(key)
        if self.rules.back:
            self.go(s.module.rel)  # back in the caller's file, if a step took the walk away
        self.steps.append((target.module.rel, target.qualname))
        self.go(target.module.rel)
        if target.fn is None or key in self.expanded:
            return
        if self_kind is None and constructor:
            self_kind = self.call_carries(call, s)
        if all(k.what == READ for k in [*bound.values(), *([self_kind] if self_kind else [])]):
            return  # given values read off the config only: a stop, not walked into
        self.expanded.add(key)
        cls = (target.module.name, target.cls.name) if target.cls is not None else None
        if self_kind is not None and target.fn.args.args:
            bound[target.fn.args.args[0].arg] = self_kind
        self.walk_function(target.fn, Scope(target.module, cls, bound, {}))

    def bind(self, target: Target, call: ast.Call, s: Scope) -> dict[str, Kind]:
        """The callee's parameters that receive the config, and how."""
        if target.fn is None:
            return {}
        params = [*target.fn.args.posonlyargs, *target.fn.args.args]
        if target.cls is not None and params and params[0].arg in ("self", "cls"):
            params = params[1:]
        out: dict[str, Kind] = {}
        by_name = {a.arg: a for a in [*params, *target.fn.args.kwonlyargs]}
        pairs = [(p, a) for p, a in zip(params, call.args) if not isinstance(a, ast.Starred)]
        pairs += [(by_name[k.arg], k.value) for k in call.keywords if k.arg in by_name]
        for param, arg in pairs:
            k = self.carries(arg, s)
            if k is not None:
                declared = self.p.class_of(target.module, param.annotation)
                out[param.arg] = Kind(k.what, k.cls or declared)
        return out

    def walk_function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, s: Scope) -> None:
        for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
            cls = self.p.class_of(s.module, a.annotation)
            if cls is not None:
                s.types[a.arg] = cls
        self.walk_body(fn.body, s)

    def walk_body(self, body: list[ast.stmt], s: Scope) -> None:
        for stmt in body:
            self.walk_stmt(stmt, s)

    def walk_stmt(self, stmt: ast.stmt, s: Scope) -> None:
        """A statement in evaluation order: its expressions, then what it binds, then its blocks."""
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):  # a nested function: read where it stands
            inner = s.inner()
            for a in [*stmt.args.posonlyargs, *stmt.args.args, *stmt.args.kwonlyargs]:
                inner.carried.pop(a.arg, None)
                declared = self.kind_of_class(self.p.class_of(s.module, a.annotation))
                if declared is not None:
                    inner.carried[a.arg] = declared
            self.walk_function(stmt, inner)
            return
        if isinstance(stmt, ast.ClassDef):
            return
        if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
            self.walk_expr(stmt.value, s)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                self.assign(t, stmt.value, s, getattr(stmt, "annotation", None))
            return
        if isinstance(stmt, ast.For | ast.AsyncFor):
            self.walk_expr(stmt.iter, s)
            k = self.carries(stmt.iter, s)
            self.bind_names(stmt.target, self.element(k), s)
            self.walk_body(stmt.body, s)
            self.walk_body(stmt.orelse, s)
            return
        if isinstance(stmt, ast.With | ast.AsyncWith):
            for item in stmt.items:
                self.walk_expr(item.context_expr, s)
                if item.optional_vars is not None:
                    self.bind_names(item.optional_vars, self.carries(item.context_expr, s), s)
            self.walk_body(stmt.body, s)
            return
        for name in ("test", "value", "exc", "msg", "subject"):  # if, while, return, expression, raise, assert, match
            self.walk_expr(e if isinstance(e := getattr(stmt, name, None), ast.expr) else None, s)
        blocks = [getattr(stmt, n, None) or [] for n in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(stmt, "handlers", [])] + [c.body for c in getattr(stmt, "cases", [])]
        for block in blocks:
            self.walk_body(block, s)

    def assign(self, target: ast.expr, value: ast.expr | None, s: Scope, annotation: ast.expr | None) -> None:
        """What the assigned names carry; a tuple from a project call takes its return annotation element-wise."""
        if isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List) and \
                len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self.assign(t, v, s, None)
            return
        if isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Call):
            for i, t in enumerate(target.elts):
                self.bind_names(t, self.call_carries(value, s, element=i), s)
            return
        if isinstance(target, ast.Name):  # the name's class, where known: resolves its methods
            t = self.resolve(value.func, s) if isinstance(value, ast.Call) else None
            built = (t.module.name, t.qualname) if t is not None and t.qualname in t.module.classes else None
            cls = (self.class_of_expr(value, s) if value is not None else None) or built or \
                self.p.class_of(s.module, annotation)
            if cls is not None:
                s.types[target.id] = cls
        self.bind_names(target, self.carries(value, s), s)

    def bind_names(self, target: ast.expr, kind: Kind | None, s: Scope) -> None:
        if isinstance(target, ast.Name):
            if kind is None:
                s.carried.pop(target.id, None)
            else:
                s.carried[target.id] = kind
        elif isinstance(target, ast.Tuple | ast.List | ast.Starred):
            for t in (target.elts if not isinstance(target, ast.Starred) else [target.value]):
                self.bind_names(t, kind, s)

    def walk_expr(self, e: ast.expr | None, s: Scope) -> None:
        """The calls of an expression in evaluation order (callee and arguments before the call); a lambda's body
        where it stands, its parameters carrying the config."""
        if e is None:
            return
        if isinstance(e, ast.Lambda):
            inner = s.inner()
            params = [*e.args.posonlyargs, *e.args.args]
            defaults = [None] * (len(params) - len(e.args.defaults)) + list(e.args.defaults)
            for p, d in zip(params, defaults):
                k = Kind("carrier") if d is None else self.carries(d, s)
                self.bind_names(ast.Name(p.arg), k, inner)
            self.walk_expr(e.body, inner)
            return
        if isinstance(e, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            inner = s.inner()
            for g in e.generators:
                self.walk_expr(g.iter, inner)
                k = self.carries(g.iter, inner)
                self.bind_names(g.target, self.element(k), inner)
                for cond in g.ifs:
                    self.walk_expr(cond, inner)
            for part in (getattr(e, "elt", None), getattr(e, "key", None), getattr(e, "value", None)):
                self.walk_expr(part, inner)
            return
        if isinstance(e, ast.NamedExpr):
            self.walk_expr(e.value, s)
            self.bind_names(e.target, self.carries(e.value, s), s)
            return
        for child in ast.iter_child_nodes(e):
            if isinstance(child, ast.expr):
                self.walk_expr(child, s)
            elif isinstance(child, ast.keyword):
                self.walk_expr(child.value, s)
        if isinstance(e, ast.Call):
            self.step(e, s)


@dataclass(frozen=True)
class WalkResult:
    """The walk's steps (file, function) and trail of stops (files), and the figures they give."""

    entry: str
    step_list: list[tuple[str, str]]
    trail: list[str]
    climbs: int

    stops = property(lambda self: len(self.trail))
    steps = property(lambda self: len(self.step_list))
    files = property(lambda self: len(set(self.trail)))
    returns = property(lambda self: self.stops - self.files)
    visits = property(lambda self: dict(sorted(Counter(self.trail).items(), key=lambda kv: (-kv[1], kv[0]))))

    def summary(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in ("entry", "stops", "steps", "files", "climbs", "returns", "visits")}


def walk_config(root: Path, rules: Rules = Rules()) -> WalkResult:
    """Walk the benchmark's config from its entry point's ``main()`` under ``root`` (see the module's docstring)."""
    project = Project(root, CONFIG_CLASS)
    entry = next((rel for rel in ENTRY_FILES if (root / rel).is_file()), None)
    if entry is None:
        raise FileNotFoundError(f"no benchmark entry point under {root} (looked for {', '.join(ENTRY_FILES)})")
    module = next(m for m in project.modules.values() if m.rel == entry)
    walk = Walk(project, rules)
    walk.go(entry)
    walk.steps.append((entry, "main"))
    walk.expanded.add((module.name, "main"))
    walk.walk_function(module.functions["main"], Scope(module, None, {}, {}))
    layers = [project.layer.get(rel.split("/")[0], 0) for rel in walk.trail]
    return WalkResult(entry, walk.steps, walk.trail, sum(b > a for a, b in zip(layers, layers[1:])))


def main(argv: list[str] | None = None) -> WalkResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the repository")
    parser.add_argument("--reads", choices=("leaf", "follow"), default="leaf", help="see Rules.reads")
    parser.add_argument("--repeats", action="store_true", help="a callee called again is a step again")
    parser.add_argument("--back", action="store_true", help="going back to the caller's file is a stop")
    parser.add_argument("--trace", action="store_true", help="print every step (file: function) and every stop")
    args = parser.parse_args(argv)
    rules = Rules(reads=args.reads, repeats=args.repeats, back=args.back)
    result = walk_config(args.root.resolve(), rules)
    if args.trace:
        print("\n".join([*(f"step {r}: {f}" for r, f in result.step_list), *(f"stop {r}" for r in result.trail)]))
    print(json.dumps(result.summary(), indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
