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

A cycle can also hide from the graph: a module that declares `TokenizerManager = Any` instead
of importing the class, or that calls another object's private method (`tm._finish(...)`),
depends on that module's internals all the same.  Both are reported as hidden back-references
(`hidden_references`); the private calls into third-party internals that have no public
equivalent are listed in `ALLOWED_PRIVATE_CALLS`, each with its reason.  The exit status is 1
when there is a cycle or a hidden back-reference.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("protocol", "telemetry", "serving", "bench", "loadtest", "dashboards", "deploy")
THIRD_PARTY = ("torch", "transformers", "zmq", "prometheus_client", "opentelemetry")
# (file, called expression) -> why calling that private member is the only way
ALLOWED_PRIVATE_CALLS = {
    (
        "serving/frontend/http/server.py",
        "proto._close_stream",
    ): "hypercorn's H2Protocol has no public way to end one HTTP/2 stream",
    ("serving/frontend/http/server.py", "proto._flush"): "the same: hypercorn's, after ending a stream",
    (
        "serving/models/layers/linear.py",
        "torch._weight_int8pack_mm",
    ): "torch's int8 weight-only matmul kernel has no public name",
    ("bench/kernels_quant.py", "torch._weight_int8pack_mm"): "the same kernel, benchmarked",
}


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
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
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


def _is_any(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Any") or (isinstance(node, ast.Attribute) and node.attr == "Any")


def _private_callee(call: ast.Call) -> str | None:
    """`obj._name` when `call` calls a private member of something other than `self`, `cls` or `super()`."""
    func = call.func
    if not isinstance(func, ast.Attribute) or not func.attr.startswith("_") or func.attr.endswith("__"):
        return None
    owner = func.value
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
        return None
    if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
        return None
    return ast.unparse(func)


def hidden_references(root: Path) -> list[str]:
    """Every `X = Any` stand-in and every call of another object's private member, as `file:line: why`."""
    found = []
    for path in modules(root).values():
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and _is_any(node.value)
            ):
                found.append(
                    f"{rel}:{node.lineno}: `{node.targets[0].id} = Any` stands in for a class: import it, "
                    "or pass what the module needs instead of the object that owns it"
                )
            elif (
                isinstance(node, ast.Call)
                and (callee := _private_callee(node)) is not None
                and (rel, callee) not in ALLOWED_PRIVATE_CALLS
            ):
                found.append(
                    f"{rel}:{node.lineno}: `{callee}()` calls another object's private member: give it a "
                    "public method (or list a third-party one in ALLOWED_PRIVATE_CALLS, with why)"
                )
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
    hidden = hidden_references(root)
    print("hidden back-references: " + ("".join(f"\n  {h}" for h in hidden) if hidden else "none"))
    return 1 if found or loops or hidden else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
