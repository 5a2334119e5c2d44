"""engine/'s modules import each other without a cycle, imports inside functions included.

A cycle is held together by a lazy import (the runner imported the scheduler inside ``generate`` while the
scheduler imported the runner): it runs, but neither module can be read, tested or moved without the
other. Imports under ``if TYPE_CHECKING:`` never run and only name types, so they are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement of ``tree`` at any depth (functions, methods, branches), less TYPE_CHECKING blocks."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if _type_checking_only(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph(package: Path, name: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, as dotted names under it (``kv.cache``; ``name`` is
    the package's import name). A name of a subpackage (``from ..kv import digest``) resolves to its module."""
    modules = {".".join(p.relative_to(package).with_suffix("").parts) for p in package.rglob("*.py")
               if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for module in sorted(modules):
        edges = graph.setdefault(module, set())
        here = module.split(".")[:-1]  # the module's subpackage, as parts under the package
        for node in _imports(ast.parse((package / (module.replace(".", "/") + ".py")).read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name.removeprefix(f"{name}.") for a in node.names if a.name.startswith(f"{name}.")]
            elif node.level:  # from .runner import Runner; from ..kv import digest
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}".strip(".") for a in node.names]
            elif node.module and node.module.startswith(f"{name}."):
                base = node.module.removeprefix(f"{name}.")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                targets = []
            edges.update(t for t in targets if t in modules and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles found by a depth-first walk, each as a path back to its start: at least one in every group of
    modules that import each other."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt in path:
                cycle = path[path.index(nxt):] + [nxt]
                if not any(set(cycle) <= set(c) for c in found):
                    found.append(cycle)
            elif nxt not in done:
                visit(path + [nxt])
        done.add(path[-1])

    for start in sorted(graph):
        if start not in done:
            visit([start])
    return found


def test_engine_modules_import_each_other_without_a_cycle():
    # GIVEN every module of engine/ and each import it makes, lazy ones included
    graph = import_graph(ENGINE, "kvdoctor.engine")
    assert {"serving.runner", "serving.scheduler", "serving.speculative", "model.sampling"} <= set(graph)
    # WHEN cycles are looked for
    found = cycles(graph)
    # THEN there are none
    assert not found, "import cycles in engine/: " + "; ".join(" -> ".join(c) for c in found)


def test_a_lazy_import_that_closes_a_cycle_is_found(tmp_path):
    # GIVEN a package whose a imports b at the top and b imports a inside a function, and a TYPE_CHECKING import
    (tmp_path / "a.py").write_text("from .b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                                   "class B:\n    def run(self):\n        from .a import thing\n")
    (tmp_path / "c.py").write_text("from .b import B\n")
    # WHEN its import graph is taken and cycles looked for
    graph = import_graph(tmp_path, "pkg")
    # THEN the lazy import is an edge, the TYPE_CHECKING one is not, and the one cycle is named
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"b"}}
    assert cycles(graph) == [["a", "b", "a"]]
