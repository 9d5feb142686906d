"""Print the import graph of a sightline checkout: which package imports which, and every
import cycle between modules.

    python scripts/import_graph.py [ROOT]          # ROOT: a checkout (default: this one)

A unit is a top-level package (`protocol`, `telemetry`, `bench`, `loadtest`...) or a
sub-package of `serving` (`serving.frontend`, `serving.engine`, ...; modules directly in
`serving/` are the unit `serving`, shared by the three processes, except the command line,
`serving.cli`).  Each line is `unit -> imported unit (number of modules that import it)`;
torch and transformers are listed too, since which processes load them matters.

Every import counts: at module level, inside a function, under `TYPE_CHECKING`, relative or
absolute.  A cycle is a set of modules that import each other in a circle (a strongly
connected component of the module graph), printed as its modules in order.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("protocol", "telemetry", "serving", "bench", "loadtest", "dashboards", "deploy")
THIRD_PARTY = ("torch", "transformers", "zmq", "prometheus_client", "opentelemetry")


def modules(root: Path) -> dict[str, Path]:
    """Every module of the checkout's packages by dotted name (a package is its `__init__`)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else ():
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(module: str, path: Path) -> set[str]:
    """Dotted names `module` imports anywhere in its file (`from a import b` gives `a` and `a.b`)."""
    names: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the checkout's modules it imports."""
    mods = modules(root)
    edges: dict[str, set[str]] = {}
    for module, path in mods.items():
        targets = set()
        for name in imported_names(module, path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        edges[module] = targets
    return edges


def module_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def unit_of(module: str, subpackages: set[str]) -> str | None:
    parts = module.split(".")
    if parts[0] in THIRD_PARTY:
        return parts[0]
    if parts[0] not in PACKAGES:
        return None
    if parts[0] == "serving" and len(parts) > 1 and parts[1] in subpackages:
        return f"serving.{parts[1]}"
    if parts[:2] in (["serving", "cli"], ["serving", "__main__"]):
        return "serving.cli"
    return parts[0]


def graph(root: Path) -> dict[str, dict[str, int]]:
    """Unit -> imported unit -> how many of the unit's modules import it."""
    subpackages = {p.name for p in (root / "serving").iterdir() if (p / "__init__.py").exists()}
    edges: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for module, path in modules(root).items():
        src = unit_of(module, subpackages)
        for dst in {unit_of(t, subpackages) for t in imported_names(module, path)} - {None, src}:
            edges[src][dst] += 1
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    """Pairs of units that import each other."""
    return sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges.get(b, {}))


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent)
    edges = graph(root)
    for src in sorted(edges):
        print(f"{src} -> " + ", ".join(f"{dst} ({n})" for dst, n in sorted(edges[src].items())))
    found = cycles(edges)
    print("unit cycles: " + (", ".join(f"{a} <-> {b}" for a, b in found) if found else "none"))
    loops = module_cycles(module_graph(root))
    print("module cycles: " + ("; ".join(" -> ".join(c) for c in loops) if loops else "none"))
    return 1 if found or loops else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
