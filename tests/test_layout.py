"""The import graph the layout promises: `protocol` is a leaf, `telemetry` depends only on
it, and the main process and the Detokenizer run without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def test_front_end_and_detokenizer_run_without_torch():
    code = ("import sys, serving.frontend.launch, serving.detokenizer.manager\n"
            "from serving.model_files import load_tokenizer\n"
            "load_tokenizer('tiny-random')\n"
            "print(sorted(m for m in ('torch', 'serving.engine.scheduler', 'serving.engine.scheduler_core') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
