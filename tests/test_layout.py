"""The package's import structure (issue #36 item 6): no import circle between its modules, counting
imports inside functions too; no private name (``_x``) imported from another of its files; and the
adapter's two processes apart: ``server/front`` (the HTTP process) and ``server/scheduler`` (each
scheduler rank) never import each other, they meet only through ``server/control``'s messages."""

from __future__ import annotations

import ast
from pathlib import Path

import sgl_agentcache

ROOT = Path(sgl_agentcache.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("sgl_agentcache",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(module -> package modules it imports, [(module, source, private name)])."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[mod].update(alias.name for alias in node.names if alias.name in mods)
                continue
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sgl_agentcache")):
                continue
            if node.module in mods:
                graph[mod].add(node.module)
            for alias in node.names:
                if f"{node.module}.{alias.name}" in mods:
                    graph[mod].add(f"{node.module}.{alias.name}")
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append((mod, node.module, alias.name))
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_in_the_package():
    graph, _ = _imports(_modules())
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_files():
    _, private = _imports(_modules())
    assert private == []


def test_the_http_front_and_the_scheduler_side_never_import_each_other():
    graph, _ = _imports(_modules())
    sides = ("sgl_agentcache.server.front", "sgl_agentcache.server.scheduler")
    crossing = sorted((mod, dep) for mod, deps in graph.items() for dep in deps
                      for here, there in (sides, sides[::-1])
                      if mod.startswith(here) and dep.startswith(there))
    assert crossing == []
    assert all(any(m.startswith(side + ".") for m in graph) for side in sides)  # both sides exist
