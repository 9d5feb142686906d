"""Goodput search: the highest load at which the SLO still holds for ≥ objective of the requests.

GuideLLM's idea (sweep the rate, find where the service stops meeting its SLO) as a bounded
search.  The load is the scenario's: requests/s for Poisson arrivals (open loop: the rate
does not slow down when the server does, so past the knee queues grow and TTFT breaks),
users for a closed loop.  Each step is one Locust run (`run_locust`) that holds one level for
`step_seconds` and is drained before the next (Locust's stop timeout lets every open request
end), so a step is judged on its own requests only.  Levels: `start`, × `factor` while the
steps pass (up to `max_level`), then bisection between the highest pass and the lowest
failure until the gap is ≤ `precision` × the failing level (one user for a closed loop),
`max_steps` steps in all.  A step passes when the share of its requests that succeeded
within every goodput threshold (`stats.meets`) is ≥ the objective; a step that sent nothing
fails (nothing to judge).  The knee is the highest passing level below the lowest failing
one.

Everything here is recomputed from the folder (records.jsonl, whose `stage` is the step,
and search_steps.json, the levels in the order run), so `--gate-only` judges a search again.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from loadtest.config import Plan, Search, Shape
from loadtest.records import RequestRecord, load_records
from loadtest.stats import Latencies, StageSummary, meets, summarize

STEPS_FILE = "search_steps.json"


@dataclass
class Step:
    index: int
    level: float  # requests/s (Poisson) or users (closed loop)
    phase: str  # ramp | bisect
    requests: int
    good: int  # succeeded within every goodput threshold
    failures: int
    attainment: float | None  # good ÷ requests; None: nothing sent
    goodput_per_s: float  # good ÷ step_seconds
    requests_per_s: float  # sent ÷ step_seconds
    passed: bool
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None


@dataclass
class SearchResult:
    arrival: str
    unit: str  # requests/s | users
    objective: float
    goodput_slo: dict[str, float]
    knee: float | None  # the highest passing level below the lowest failing one; None: no level passed
    knee_step: int | None
    knee_goodput_per_s: float | None
    capped: bool  # every step passed up to max_level: the knee is at least max_level
    steps: list[Step]


def bounds(steps: list[Step]) -> tuple[float, float | None]:
    """(highest pass below the lowest failure, or 0; the lowest failure, or None)."""
    hi = min((s.level for s in steps if not s.passed), default=None)
    lo = max((s.level for s in steps if s.passed and (hi is None or s.level < hi)), default=0.0)
    return lo, hi


def next_level(search: Search, closed: bool, steps: list[Step]) -> float | None:
    """The next level to hold, or None when the search is over (steps used up, bracket narrow enough,
    or max_level passed)."""
    if len(steps) >= search.max_steps:
        return None
    if not steps:
        return search.start
    lo, hi = bounds(steps)
    if hi is None:  # ramp: every step so far passed
        if lo >= search.max_level:
            return None
        up = max(lo + 1, round(lo * search.factor)) if closed else lo * search.factor
        return min(up, search.max_level)
    if closed:
        return None if hi - lo <= 1 else float((int(lo) + int(hi)) // 2)
    return None if hi - lo <= search.precision * hi else (lo + hi) / 2


def judge(
    index: int,
    level: float,
    phase: str,
    recs: list[RequestRecord],
    goodput: dict[str, float],
    objective: float,
    step_seconds: float,
) -> Step:
    good = sum(meets(r, goodput) for r in recs)
    lat = Latencies.of(recs)
    attainment = good / len(recs) if recs else None
    return Step(
        index,
        level,
        phase,
        len(recs),
        good,
        sum(not r.ok for r in recs),
        attainment,
        good / step_seconds,
        len(recs) / step_seconds,
        attainment is not None and attainment >= objective,
        lat.ttft_ms.p99,
        lat.tpot_ms.p99,
    )


def judge_all(levels: list[float], recs: list[RequestRecord], plan: Plan) -> list[Step]:
    """Every step from the merged records (`stage` = step index); a step is `ramp` until the first failure."""
    sc = plan.scenario
    steps: list[Step] = []
    for i, level in enumerate(levels):
        phase = "ramp" if all(s.passed for s in steps) else "bisect"
        steps.append(
            judge(
                i,
                level,
                phase,
                [r for r in recs if r.stage == i],
                sc.goodput,
                sc.search.objective,
                sc.search.step_seconds,
            )
        )
    return steps


def result(plan: Plan, steps: list[Step]) -> SearchResult:
    sc = plan.scenario
    lo, hi = bounds(steps)
    knee = next((s for s in steps if s.passed and s.level == lo), None) if lo else None
    return SearchResult(
        sc.arrival,
        "users" if sc.arrival == "closed" else "requests/s",
        sc.search.objective,
        dict(sc.goodput),
        knee.level if knee else None,
        knee.index if knee else None,
        knee.goodput_per_s if knee else None,
        hi is None and bool(steps) and lo >= sc.search.max_level,
        steps,
    )


def load_result(out: Path, plan: Plan, recs: list[RequestRecord]) -> SearchResult:
    levels = json.loads((out / STEPS_FILE).read_text()) if (out / STEPS_FILE).exists() else []
    return result(plan, judge_all(levels, recs, plan))


def step_stages(recs: list[RequestRecord], steps: list[Step], plan: Plan) -> list[StageSummary]:
    """One StageSummary per step, each on its own clock (steps are separate runs with gaps between)."""
    secs = plan.scenario.search.step_seconds
    out = []
    for st in steps:
        mine = [replace(r, stage=0) for r in recs if r.stage == st.index]
        if mine:
            out.append(replace(summarize(mine, plan.scenario.goodput, secs).stages[0], stage=st.index))
        else:
            out.append(StageSummary(st.index, st.level, 0, 0, 0.0, 0.0, Latencies.of([])))
    return out


def run_search(plan: Plan, out: Path, run_locust: Callable[[Plan, Path, bool], int]) -> int:
    """Run the steps; merge their records into out/records.jsonl. Returns the worst Locust exit code."""
    sc = plan.scenario
    search = sc.search
    steps: list[Step] = []
    levels: list[float] = []
    worst = 0
    with open(out / "records.jsonl", "a") as merged:
        while (level := next_level(search, sc.arrival == "closed", steps)) is not None:
            i = len(steps)
            d = out / "steps" / f"{i:02d}"
            d.mkdir(parents=True, exist_ok=True)
            step_plan = replace(
                plan,
                scenario=replace(sc, shape=Shape((level,), search.step_seconds), search=None),
                records_path=str(d / "records.jsonl"),
            )
            (d / "plan.json").write_text(step_plan.to_json())
            rc = run_locust(step_plan, d, False)
            worst = worst or rc
            recs = [replace(r, stage=i) for r in load_records(d / "records.jsonl")]
            merged.writelines(r.to_json() + "\n" for r in recs)
            phase = "ramp" if all(s.passed for s in steps) else "bisect"
            steps.append(judge(i, level, phase, recs, sc.goodput, search.objective, search.step_seconds))
            levels.append(level)
            (out / STEPS_FILE).write_text(json.dumps(levels))
            s = steps[-1]
            print(
                f"  step {i} ({phase}) level {level:g}: {s.good}/{s.requests} within the SLO "
                f"({_pct(s.attainment)}) → {'pass' if s.passed else 'fail'}",
                flush=True,
            )
    return worst


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _ms(v: float | None) -> str:
    return "—" if v is None or math.isnan(v) else f"{v:.0f}"


def search_lines(r: SearchResult) -> list[str]:
    slo = ", ".join(f"{k[:-3]} ≤ {v:g} ms" for k, v in r.goodput_slo.items()) or "no threshold"
    lines = [
        f"goodput search ({'Poisson arrivals' if r.arrival == 'poisson' else 'closed loop'}, {r.unit}): "
        f"≥ {r.objective:.1%} of requests succeed within {slo}",
        f"  {'step':>4} {'phase':<6} {'level':>7} {'reqs':>5} {'good':>5} {'within':>7} {'goodput/s':>9} "
        f"{'TTFT p99':>8} {'TPOT p99':>8}",
    ]
    for s in r.steps:
        lines.append(
            f"  {s.index:>4} {s.phase:<6} {s.level:>7g} {s.requests:>5} {s.good:>5} {_pct(s.attainment):>7} "
            f"{s.goodput_per_s:>9.2f} {_ms(s.ttft_p99_ms):>8} {_ms(s.tpot_p99_ms):>8}  "
            f"{'pass' if s.passed else 'FAIL'}"
        )
    if r.knee is None:
        lines.append("knee: none — no level met the SLO")
    else:
        lines.append(
            f"knee: {r.knee:g} {r.unit} (step {r.knee_step}, goodput {r.knee_goodput_per_s:.2f} req/s)"
            + (" — every step passed up to max_level: the knee is at least this" if r.capped else "")
        )
    return lines
