"""Print the package-level import graph of a sightline checkout: which package imports which.

    python scripts/import_graph.py [ROOT]          # ROOT: a checkout (default: this one)

A unit is a top-level package (`protocol`, `telemetry`) or a sub-package of `serving`
(`serving.frontend`, `serving.engine`, ...; modules directly in `serving/` are the unit
`serving`, shared by the three processes, except the command line, `serving.cli`). Every import counts, module level or inside a function. Each line is
`unit -> imported unit (number of modules that import it)`; torch and transformers are
listed too, since which processes load them matters. Cycles between units are reported.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("protocol", "telemetry", "serving")
THIRD_PARTY = ("torch", "transformers", "zmq", "prometheus_client", "opentelemetry")


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
    subpackages = {p.name for p in (root / "serving").iterdir() if (p / "__init__.py").exists()}
    edges: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            src = unit_of(module, subpackages)
            targets: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    targets.add(node.module)
            for dst in {unit_of(t, subpackages) for t in targets} - {None, src}:
                edges[src][dst] += 1
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges.get(b, {}))


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent)
    edges = graph(root)
    for src in sorted(edges):
        print(f"{src} -> " + ", ".join(f"{dst} ({n})" for dst, n in sorted(edges[src].items())))
    found = cycles(edges)
    print("cycles: " + (", ".join(f"{a} <-> {b}" for a, b in found) if found else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
