"""The import graph the layout promises: `protocol` is a leaf, `telemetry` depends only on
it, and the main process and the Detokenizer run without torch."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(package: str) -> set[str]:
    """Top-level packages imported anywhere in `package` (module level or inside functions)."""
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def test_protocol_is_a_leaf():
    assert not imported_packages("protocol") & {"torch", "telemetry", "serving", "transformers"}


def test_telemetry_imports_no_serving_module():
    assert "serving" not in imported_packages("telemetry")


def test_packages_by_process_import_each_other_without_cycles():
    """The graph `scripts/import_graph.py` prints: no cycle, and only the front end may reach
    the engine and the Detokenizer (lazily: the spawn target imports them in the child)."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    graph_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph_module)
    edges = graph_module.graph(ROOT)
    assert graph_module.cycles(edges) == []
    ours = {"protocol", "telemetry", "serving", "serving.cli", "serving.frontend", "serving.engine",
            "serving.models", "serving.detokenizer"}
    assert set(edges["telemetry"]) & ours == {"protocol"}
    assert set(edges["serving.engine"]) & ours <= {"protocol", "telemetry", "serving", "serving.models"}
    assert set(edges["serving.detokenizer"]) & ours <= {"protocol", "telemetry", "serving"}
    assert set(edges["serving.models"]) & ours <= {"serving"}
    assert "serving.frontend" not in {dst for src in edges for dst in edges[src] if src != "serving.cli"}


def test_front_end_and_detokenizer_run_without_torch():
    code = ("import sys, serving.frontend.launch, serving.detokenizer.manager\n"
            "from serving.model_files import load_tokenizer\n"
            "load_tokenizer('tiny-random')\n"
            "print(sorted(m for m in ('torch', 'serving.engine.scheduler', 'serving.engine.scheduler_core') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
