"""A small PromQL and dashboard linter, in the spirit of Grafana's dashboard-linter.

It scans PromQL lexically (strings, label matchers and ranges skipped; `by (...)`
label lists told apart from calls), which is enough for the rules we hold our
queries to: counters (our catalogue's, else by suffix `_total`, `_count`, `_sum`, `_bucket`) only inside
`rate`/`increase`/`irate`, dashboard ranges always `$__rate_interval`, and every
panel with a title, a description, a unit and the Prometheus datasource.

    python -m dashboards.lint    # lint the committed dashboards and rules
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

from telemetry.metrics import BY_NAME

COUNTER = re.compile(r"_(total|count|sum|bucket)$")
COUNTER_FUNCS = {"rate", "increase", "irate"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
}  # before `by (...)` they are not followed by "("
KEYWORDS = GROUPING | AGGREGATIONS | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "Inf", "NaN"}
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?[smhdwy]*")
RATE_INTERVAL = "$__rate_interval"


def _skip_to(expr: str, i: int, close: str) -> tuple[int, str]:
    """Index after the `close` matching expr[i]'s opener (strings inside skipped), and the content."""
    start, j = i + 1, i + 1
    while j < len(expr) and expr[j] != close:
        if expr[j] in "\"'`":
            j = _skip_to(expr, j, expr[j])[0] - 1
        j += 1
    return j + 1, expr[start:j]


def scan(expr: str) -> tuple[list[tuple[str, list[str | None]]], list[str]]:
    """(every metric name with the stack of calls around it, every range's content)."""
    metrics: list[tuple[str, list[str | None]]] = []
    ranges: list[str] = []
    stack: list[str | None] = []  # call name, "group" for a label list, None for plain parentheses
    i = 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _skip_to(expr, i, c)[0]
        elif c == "{":
            i = _skip_to(expr, i, "}")[0]
        elif c == "[":
            i, content = _skip_to(expr, i, "]")
            ranges.append(content)
        elif c == "(":
            stack.append(None)
            i += 1
        elif c == ")":
            if stack:
                stack.pop()
            i += 1
        elif (m := NUMBER.match(expr, i)) and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] == "_")):
            i = m.end()
        elif m := IDENT.match(expr, i):
            name, i = m.group(), m.end()
            rest = expr[i:].lstrip()
            if rest.startswith("("):
                stack.append("group" if name in GROUPING else name)
                i = len(expr) - len(rest) + 1
            elif name not in KEYWORDS and "group" not in stack[-1:]:
                metrics.append((name, list(stack)))
        else:
            i += 1
    return metrics, ranges


def is_counter(name: str) -> bool:
    """Our catalogue decides (`sightline_kv_slots_total` is a gauge); other names by their suffix."""
    if name in BY_NAME:
        return BY_NAME[name].kind == "counter"
    base, _, suffix = name.rpartition("_")
    if base in BY_NAME and suffix in ("bucket", "count", "sum"):
        return BY_NAME[base].kind == "histogram"
    return bool(COUNTER.search(name))


def metric_names(expr: str) -> set[str]:
    return {name for name, _ in scan(expr)[0]}


def expr_problems(expr: str, *, dashboard: bool) -> list[str]:
    metrics, ranges = scan(expr)
    out = []
    for name, stack in metrics:
        calls = [s for s in stack if s is not None]
        if is_counter(name) and (not calls or calls[-1] not in COUNTER_FUNCS):
            out.append(f"counter {name} outside rate/increase/irate")
    if dashboard:
        out += [f"range [{r}] is not [{RATE_INTERVAL}]" for r in ranges if r != RATE_INTERVAL]
    return out


def panels(dashboard: dict) -> list[dict]:
    """Every non-row panel, rows' nested panels included."""
    out = []
    for p in dashboard.get("panels", []):
        out += panels(p) if p.get("type") == "row" else [p]
    return out


def dashboard_problems(dashboard: dict, prometheus_uid: str = "prometheus") -> list[str]:
    out = []
    for p in panels(dashboard):
        where = f"{dashboard['uid']} / {p.get('title') or p.get('id')}"
        for key in ("title", "description"):
            if not p.get(key):
                out.append(f"{where}: no {key}")
        if not p.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            out.append(f"{where}: no unit")
        if p.get("datasource", {}).get("uid") != prometheus_uid:
            out.append(f"{where}: datasource is not uid {prometheus_uid!r}")
        if not p.get("targets"):
            out.append(f"{where}: no queries")
        for t in p.get("targets", []):
            out += [f"{where} [{t.get('refId')}]: {problem}" for problem in expr_problems(t["expr"], dashboard=True)]
    for a in dashboard.get("annotations", {}).get("list", []):
        where = f"{dashboard['uid']} / annotation {a.get('name')}"
        if a.get("datasource", {}).get("uid") != prometheus_uid or not a.get("expr"):
            out.append(f"{where}: not a query on uid {prometheus_uid!r}")
        out += [f"{where}: {problem}" for problem in expr_problems(a.get("expr", ""), dashboard=True)]
    names = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    out += [f"{dashboard['uid']}: no ${v} variable" for v in ("job", "instance", "model_name") if v not in names]
    return out


def rule_exprs(rule_file: dict) -> list[tuple[str, str]]:
    """(rule name, expr) for every recording and alerting rule of a rule file."""
    return [(r.get("record") or r["alert"], r["expr"]) for g in rule_file["groups"] for r in g["rules"]]


def main() -> int:
    root = Path(__file__).parent
    problems = []
    for path in sorted((root / "grafana/dashboards").glob("*.json")):
        problems += dashboard_problems(json.loads(path.read_text()))
    for path in sorted((root / "prometheus/rules").glob("*.yml")):
        for name, expr in rule_exprs(yaml.safe_load(path.read_text())):
            problems += [f"{path.name} {name}: {p}" for p in expr_problems(expr, dashboard=False)]
    print("\n".join(problems) or "no problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
