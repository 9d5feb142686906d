"""One load-test run, step by step: warm up, scrape, Locust headless, scrape, analyse.

Locust runs as its own process (`python -m locust -f loadtest/locustfile.py --headless
--plan plan.json`: the same locustfile a plain `locust` run uses) so its CSV and HTML are
exactly Locust's; its exit code only says whether Locust itself worked (failed requests
are the gate's business).  A goodput search (loadtest/search.py) runs one Locust process
per step.
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
from loadtest.gate import GOODPUT_KNEE_MIN, Check, evaluate
from loadtest.plots import write_all
from loadtest.reconcile import Reconciliation, Scrape, reconcile
from loadtest.records import load_records
from loadtest.report import gate_lines, reconciliation_lines, summary_lines, write_summary
from loadtest.search import SearchResult, load_result, search_lines, step_stages
from loadtest.server import REPO, auth_headers
from loadtest.stats import summarize
from loadtest.workloads import build_request

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def warm_up(plan: Plan) -> None:
    """One short request per workload before the first scrape, so first-call costs stay out of the run."""
    rng = random.Random(plan.seed)
    for w in plan.workloads:
        path, body = build_request(w, plan, rng)
        if w.endpoint != "embeddings":
            body.update(max_tokens=2, stream=False)
            body.pop("stream_options")
        httpx.post(plan.url + path, json=body, headers=auth_headers(), timeout=w.timeout_s)


def run_locust(plan: Plan, out: Path, csv: bool = True) -> int:
    """Locust headless on `out/plan.json` (written by the caller); `csv=False` spares a search step
    the CSV writer's last-second wait at shutdown."""
    stop_timeout = max(w.timeout_s for w in plan.workloads) + 10
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        plan.url,
        "--plan",
        str(out / "plan.json"),
        "--html",
        str(out / "locust.html"),
        "--only-summary",
        "--stop-timeout",
        f"{stop_timeout:g}",
        "--exit-code-on-error",
        "0",
        "--loglevel",
        "WARNING",
        *(["--csv", str(out / "locust")] if csv else []),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(out / "locust.log", "wb") as log:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=plan.scenario.shape.duration + stop_timeout + 120,
        )
    return proc.returncode


@dataclass
class Outcome:
    passed: bool  # the SLO gate (and, when required, the reconciliation)
    requests: int
    checks: list[Check]
    reconciliation: Reconciliation
    text: str
    search: SearchResult | None = None


def analyse(
    out: Path, plan: Plan, slo: dict[str, float], require_reconcile: bool, run_info: dict, write: bool = True
) -> Outcome:
    """Summary, reconciliation, gate (and, with `write`, plots, summary.json, report.txt) from what
    the run left in `out`: records.jsonl and the two /metrics scrapes.  For a goodput search the
    stages are its steps and the gate judges the knee's step (plus `goodput_knee_min`, by default:
    some level met the SLO), since the steps past the knee miss the SLO by design."""
    before, after = load_scrape(out / "metrics_before.txt"), load_scrape(out / "metrics_after.txt")
    recs = load_records(out / "records.jsonl")
    summary = summarize(recs, plan.scenario.goodput, plan.scenario.shape.stage_seconds)
    judged, search = summary, None
    if plan.scenario.search:
        search = load_result(out, plan, recs)
        summary.stages = step_stages(recs, search.steps, plan)
        judged = summarize(
            [r for r in recs if r.stage == search.knee_step], plan.scenario.goodput, plan.scenario.search.step_seconds
        )
        slo = {GOODPUT_KNEE_MIN: 0.0, **slo}
    rec = reconcile(
        recs, before, after, plan.model, {q: getattr(summary.latency.ttft_ms, q) for q in ("p50", "p90", "p99")}
    )
    checks = evaluate(judged, slo, prefix_hit_ratio=rec.prefix_hit_ratio, knee=search.knee if search else None)
    if require_reconcile:
        checks.append(Check("reconciliation", "==", 1.0, float(rec.ok), rec.ok))
    if not recs:
        checks.append(Check("requests_sent", ">=", 1.0, 0.0, False))
    text = "\n".join(
        [
            *summary_lines(summary),
            *(search_lines(search) if search else []),
            *reconciliation_lines(rec),
            *gate_lines(checks),
            f"results: {out}",
        ]
    )
    if write:
        plots = (
            write_all(
                recs,
                summary,
                plan.scenario.arrival,
                plan.scenario.shape.stage_seconds,
                plan.scenario.shape.levels,
                out,
                search,
            )
            if recs
            else []
        )
        write_summary(out / "summary.json", run_info, summary, rec, checks, plots, search)
        (out / "report.txt").write_text(text + "\n")
    return Outcome(all(c.passed for c in checks), len(recs), checks, rec, text, search)


def save_scrape(s: Scrape | None, path: Path) -> None:
    if s is not None:
        path.write_text(s.text)


def load_scrape(path: Path) -> Scrape | None:
    return Scrape.parse(path.read_text()) if path.exists() else None


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
