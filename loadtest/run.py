"""One load-test run, step by step: warm up, scrape, Locust headless, scrape, analyse.

Locust runs as its own process (`python -m locust`, headless, with the plan in
SIGHTLINE_LOADTEST_PLAN) so its CSV and HTML are exactly Locust's; its exit code only
says whether Locust itself worked (failed requests are the gate's business).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.config import Plan
from loadtest.gate import Check, evaluate
from loadtest.plots import write_all
from loadtest.reconcile import Reconciliation, Scrape, reconcile
from loadtest.records import load_records
from loadtest.report import gate_lines, reconciliation_lines, summary_lines, write_summary
from loadtest.server import REPO, auth_headers
from loadtest.stats import summarize
from loadtest.workloads import build_request

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
PLAN_ENV = "SIGHTLINE_LOADTEST_PLAN"


def warm_up(plan: Plan) -> None:
    """One short request per workload before the first scrape, so first-call costs stay out of the run."""
    rng = random.Random(plan.seed)
    for w in plan.workloads:
        path, body = build_request(w, plan, rng)
        body.update(max_tokens=2, stream=False)
        body.pop("stream_options")
        httpx.post(plan.url + path, json=body, headers=auth_headers(), timeout=w.timeout_s)


def run_locust(plan: Plan, out: Path) -> int:
    stop_timeout = max(w.timeout_s for w in plan.workloads) + 10
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", plan.url,
           "--csv", str(out / "locust"), "--html", str(out / "locust.html"), "--only-summary",
           "--stop-timeout", f"{stop_timeout:g}", "--exit-code-on-error", "0", "--loglevel", "WARNING"]
    env = {**os.environ, PLAN_ENV: str(out / "plan.json"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(out / "locust.log", "wb") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=plan.scenario.shape.duration + stop_timeout + 120)
    return proc.returncode


@dataclass
class Outcome:
    passed: bool  # the SLO gate (and, when required, the reconciliation)
    requests: int
    checks: list[Check]
    reconciliation: Reconciliation
    text: str


def analyse(out: Path, plan: Plan, slo: dict[str, float], require_reconcile: bool, run_info: dict,
            write: bool = True) -> Outcome:
    """Summary, reconciliation, gate (and, with `write`, plots, summary.json, report.txt) from what
    the run left in `out`: records.jsonl and the two /metrics scrapes."""
    before, after = load_scrape(out / "metrics_before.txt"), load_scrape(out / "metrics_after.txt")
    recs = load_records(out / "records.jsonl")
    summary = summarize(recs, plan.scenario.goodput, plan.scenario.shape.stage_seconds)
    rec = reconcile(recs, before, after, plan.model, {q: getattr(summary.latency.ttft_ms, q)
                                                      for q in ("p50", "p90", "p99")})
    checks = evaluate(summary, slo, prefix_hit_ratio=rec.prefix_hit_ratio)
    if require_reconcile:
        checks.append(Check("reconciliation", "==", 1.0, float(rec.ok), rec.ok))
    if not recs:
        checks.append(Check("requests_sent", ">=", 1.0, 0.0, False))
    text = "\n".join([*summary_lines(summary), *reconciliation_lines(rec), *gate_lines(checks),
                      f"results: {out}"])
    if write:
        plots = write_all(recs, summary, plan.scenario.arrival, plan.scenario.shape.stage_seconds,
                          plan.scenario.shape.levels, out) if recs else []
        write_summary(out / "summary.json", run_info, summary, rec, checks, plots)
        (out / "report.txt").write_text(text + "\n")
    return Outcome(all(c.passed for c in checks), len(recs), checks, rec, text)


def save_scrape(s: Scrape | None, path: Path) -> None:
    if s is not None:
        path.write_text(s.text)


def load_scrape(path: Path) -> Scrape | None:
    return Scrape.parse(path.read_text()) if path.exists() else None


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
