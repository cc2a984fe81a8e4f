"""No cycle between the project's modules, counting every import: those inside functions too.

An import inside a function hides a cycle from Python (the module is complete by the time the
function runs) but not from the reader: two modules that import each other are one module in two
files, and neither can be understood, tested or moved alone. What two modules share goes into a
third that both import.

The graph: an edge from a module to every project module it imports (``from package import
module`` is an edge to that module, ``from module import name`` to the module), and to the
packages above that one (their ``__init__`` runs first) that are not above the importer. ``__main__.py`` entry points are
left out: nothing imports them.
"""

from __future__ import annotations

import os

from tests.architecture.test_layers import ALL, MODULES, REPO, _imports


def import_graph(modules: dict, known: set) -> dict:
    """``{module: {imported module: line}}`` from ``{module: [(target, names, line)]}``, over the
    modules in ``known``."""
    graph = {}
    for module, imports in modules.items():
        edges = graph.setdefault(module, {})
        for target, names, line in imports:
            reached = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            if len(reached) < len(names) or not names:  # a name defined in target itself
                reached.append(target)
            for name in reached:
                if name in known and name != module:
                    edges.setdefault(name, line)
                parts = name.split(".")
                for depth in range(1, len(parts)):  # the packages above it, not those above module
                    package = ".".join(parts[:depth])
                    if package in known and not module.startswith(package + "."):
                        edges.setdefault(package, line)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative),
    each sorted; sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
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
    return sorted(found)


def _explain(component: list, graph: dict, paths: dict) -> str:
    """The imports inside one cycle, as ``path:line: a imports b``."""
    inside = set(component)
    return "; ".join(f"{os.path.relpath(paths[a], REPO)}:{line}: {a} imports {b}"
                     for a in component for b, line in sorted(graph[a].items()) if b in inside)


def test_the_checker_finds_cycles_hidden_in_functions_and_packages():
    modules = {
        "pkg.a": [("pkg.b", ["helper"], 3)],
        "pkg.b": [("pkg", ["a"], 40)],  # from pkg import a, inside a function
        "pkg.c": [("pkg.b", [], 1)],  # imports the cycle, is not in it
        "pkg": [],
        "other.x": [("other", ["VALUE"], 2)],  # a name from its own package's __init__
        "other": [("other.y", [], 1)],
        "other.y": [("other.x", [], 5)],
        "fine.p": [("fine.sub", ["CONSTANT"], 1), ("json", [], 2)],  # fine.sub, and fine above it
        "fine.q": [("fine.sub.r", [], 1)],
        "fine.sub.r": [("fine", ["p"], 1)],  # fine's __init__ and fine.p: no way back
        "fine": [], "fine.sub": [],
    }
    graph = import_graph(modules, set(modules))
    assert cycles(graph) == [["other", "other.x", "other.y"], ["pkg.a", "pkg.b"]]


def test_no_cycle_between_modules():
    paths = {module: path for module, path in ALL if not path.endswith("__main__.py")}
    graph = import_graph({module: list(_imports(module, path)) for module, path in paths.items()}, MODULES)
    found = cycles(graph)
    assert not found, "import cycles (put what the modules share into a module both import): " + " | ".join(
        _explain(component, graph, paths) for component in found)
