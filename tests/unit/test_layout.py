"""The import graph the layout promises: `protocol` is a leaf, `telemetry` depends only on
it, no module imports another in a circle, the Detokenizer and a warm main process run
without torch, and engine state has one writer."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.helpers import REPO, script_module

ROOT = REPO


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


def _import_graph():
    return script_module("import_graph")


def test_protocol_is_a_leaf():
    assert not imported_packages("protocol") & {"torch", "telemetry", "serving", "transformers"}


def test_telemetry_imports_no_serving_module():
    assert "serving" not in imported_packages("telemetry")


def test_packages_by_process_import_each_other_without_cycles():
    """The graph `scripts/import_graph.py` prints: no cycle, and only the front end may reach
    the engine and the Detokenizer (lazily: the spawn target imports them in the child)."""
    graph_module = _import_graph()
    edges = graph_module.graph(ROOT)
    assert graph_module.cycles(edges) == []
    ours = {
        "protocol",
        "telemetry",
        "serving",
        "serving.cli",
        "serving.frontend",
        "serving.engine",
        "serving.models",
        "serving.detokenizer",
    }
    assert set(edges["telemetry"]) & ours == {"protocol"}
    assert set(edges["serving.engine"]) & ours <= {"protocol", "telemetry", "serving", "serving.models"}
    assert set(edges["serving.detokenizer"]) & ours <= {"protocol", "telemetry", "serving"}
    assert set(edges["serving.models"]) & ours <= {"serving"}
    # the command line starts the front end; a benchmark may drive its parts in-process
    assert "serving.frontend" not in {dst for src in edges for dst in edges[src] if src not in ("serving.cli", "bench")}


def test_front_end_and_detokenizer_run_without_torch():
    code = (
        "import sys, serving.frontend.launch, serving.detokenizer.manager\n"
        "from serving.model_files import load_tokenizer\n"
        "load_tokenizer('tiny-random')\n"
        "print(sorted(m for m in ('torch', 'serving.engine.scheduler', 'serving.engine.scheduler_core') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_no_import_cycle_between_modules():
    """No two modules import each other in a circle anywhere in the tree, counting imports
    inside functions and under TYPE_CHECKING (`scripts/import_graph.py` prints them)."""
    graph_module = _import_graph()
    assert graph_module.module_cycles(graph_module.module_graph(ROOT)) == []


def test_module_cycles_are_found():
    """The cycle finder itself: a circle through three modules and one inside a function."""
    graph_module = _import_graph()
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert graph_module.module_cycles(edges) == [["a", "b", "c"], ["e", "f"]]


def test_no_hidden_back_reference():
    """No module stands a class in with `X = Any` or calls another object's private member: a
    dependency the import graph cannot see (`scripts/import_graph.py` prints them)."""
    assert _import_graph().hidden_references(ROOT) == []


def test_hidden_back_references_are_found(tmp_path):
    """The finder itself: a stand-in and a private call are found; `self`, `cls` and `super()` calls are not."""
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "a.py").write_text(
        "from typing import Any\nManager = Any\n\n\nclass A:\n    def f(self, tm):\n"
        "        self._g()\n        super()._g()\n        tm._finish(1)\n        return tm.__len__()\n"
    )
    found = _import_graph().hidden_references(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == ["serving/a.py:2", "serving/a.py:9"]
    assert "`Manager = Any`" in found[0] and "`tm._finish()`" in found[1]


def _monitor_fields() -> set[str]:
    """The fields EngineMonitor keeps its state in: every private attribute its methods assign on `self`."""
    tree = ast.parse((ROOT / "serving/frontend/supervision/engine_monitor.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineMonitor")
    return {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute)
        and isinstance(t.value, ast.Name)
        and t.value.id == "self"
        and t.attr.startswith("_")
    }


def test_engine_state_is_written_only_by_the_monitor():
    """EngineMonitor's state changes only through its methods, whatever name the monitor goes by
    (`monitor.x =`, `mon.x =`, `state.monitor.x =`, `setattr(...)`): every field it keeps is private
    behind a read-only property, so assigning one from outside raises, and no module assigns or
    setattr()s a private monitor field of anything but `self`."""
    from serving.frontend.supervision.engine_monitor import EngineMonitor

    fields = _monitor_fields()
    assert {"_paused", "_failure", "_down", "_shutting_down", "_procs", "_restart_status", "_ready"} <= fields
    mon = EngineMonitor(stall_timeout=1.0, watchdog_timeout=1.0)
    for name in sorted(
        f.lstrip("_") for f in fields if isinstance(getattr(EngineMonitor, f.lstrip("_"), None), property)
    ):
        with pytest.raises(AttributeError):
            setattr(mon, name, None)
    public = {n for n in vars(mon) if not n.startswith("_")}
    assert public <= {
        "dp_size",
        "roles",
        "stall_timeout",
        "queue_stuck_timeout",
        "watchdog_timeout",
        "on_stats",
        "ready_log",
    }, f"engine state kept in public attributes (make them private behind a property): {public}"
    offenders = []
    for path in sorted((ROOT / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for sub in (s for t in targets for s in ast.walk(t)):  # tuple targets too
                if (
                    isinstance(sub, ast.Attribute)
                    and sub.attr in fields
                    and not (isinstance(sub.value, ast.Name) and sub.value.id == "self")
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns .{sub.attr}")
                elif isinstance(sub, ast.Attribute) and f"_{sub.attr}" in fields and "mon" in ast.unparse(sub.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns monitor field .{sub.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) > 1
                and not isinstance(node.args[1], ast.Constant)
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} setattr with a computed name")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) > 1
                and str(node.args[1].value).lstrip("_") in {f.lstrip("_") for f in fields}
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} setattr {node.args[1].value}")
    assert offenders == []
