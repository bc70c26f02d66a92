"""No import cycle among the modules of the ``kvactors`` package.

Every ``.py`` file under ``kvactors/`` is parsed (nothing is imported) and each of its
``import`` statements becomes an edge to the ``kvactors`` module it names. All three kinds
of import count:

* module level (inside a module-level ``try``/``if`` or class body too): run at import;
* under ``if TYPE_CHECKING:``: the type checker and the reader still need the other
  module to understand this one;
* inside a function (a lazy import): it only defers the cycle to the first call; the two
  modules still cannot be understood, tested or loaded one without the other.

``from package import name`` is an edge to ``package.name`` when that is a module, else to
``package`` (its ``__init__``). Not counted: the implicit import of a module's parent
packages, or a package ``__init__`` re-exporting its own submodules would be a cycle
with each of them.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parent.parent / "kvactors"

KNOWN_CYCLES: list[frozenset[str]] = []
"""Cycles through files being changed elsewhere, each as the set of its modules; to be emptied.
A listed cycle that no longer exists fails too, so that the list only ever shrinks."""

Edges = Mapping[str, Mapping[str, frozenset[str]]]
"""module -> imported module -> the kinds of import (``module``, ``type_checking``, ``function``)."""


def modules_of(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement of a module with its kind: ``module``, ``type_checking`` or ``function``."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, kind
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    yield from walk(ast.Module([statement], []), "type_checking" if kind == "module" else kind)
                for statement in child.orelse:
                    yield from walk(ast.Module([statement], []), kind)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, "function" if kind == "module" else kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, "module")


def import_graph(root: Path) -> Edges:
    """The imports among the modules of the package at ``root``."""
    modules = modules_of(root)
    edges: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, kind in imports_of(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = name.split(".") if is_package else name.split(".")[:-1]
                    parent = parent[:len(parent) - (node.level - 1)]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(name, {}).setdefault(target, set()).add(kind)
    return {name: {target: frozenset(kinds) for target, kinds in out.items()} for name, out in edges.items()}


def cycles(edges: Edges) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    nodes = sorted(set(edges) | {target for out in edges.values() for target in out})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, {})))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def describe(component: frozenset[str], edges: Edges) -> str:
    """One cycle through ``component``, shortest from its first module, each edge with its kinds."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(edges.get(node, {})):
            if target == start:
                path = [*paths[node], start]
                hops = [f"{a} ({'/'.join(sorted(edges[a][b]))})" for a, b in itertools.pairwise(path)]
                return " -> ".join([*hops, start])
            if target in component and target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def test_no_import_cycle_among_kvactors_modules() -> None:
    edges = import_graph(PACKAGE)
    found = cycles(edges)
    new = [describe(component, edges) for component in found if component not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(new)
    gone = [sorted(component) for component in KNOWN_CYCLES if component not in found]
    assert not gone, f"listed in KNOWN_CYCLES but gone (remove them): {gone}"


def test_the_walk_sees_every_kind_of_import_and_names_the_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nA = 1\n"
                                  "if TYPE_CHECKING:\n    from pkg.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("from pkg import a\n")
    (package / "d.py").write_text("import pkg.c\n")
    edges = import_graph(package)
    assert edges == {"pkg": {"pkg.a": {"module"}}, "pkg.a": {"pkg.sub.b": {"type_checking"}},
                     "pkg.sub.b": {"pkg.c": {"function"}}, "pkg.c": {"pkg.a": {"module"}},
                     "pkg.d": {"pkg.c": {"module"}}}
    (component,) = cycles(edges)
    assert component == {"pkg.a", "pkg.sub.b", "pkg.c"}
    assert describe(component, edges) == ("pkg.a (type_checking) -> pkg.sub.b (function) -> pkg.c (module) "
                                          "-> pkg.a")
    (package / "c.py").write_text("")
    assert cycles(import_graph(package)) == []
