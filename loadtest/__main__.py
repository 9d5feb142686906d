"""`python -m loadtest` (`make loadtest ARGS=...`): one command for a whole load test.

    python -m loadtest                                  # start smollm2-135m locally, run the default scenario
    python -m loadtest --url http://127.0.0.1:8000 --scenario poisson --slo ttft_p99_ms=2000
    python -m loadtest --model tiny-random --levels 1,8,32 --stage-seconds 30
    python -m loadtest --gate-only results/loadtest/default-... --slo itl_p99_ms=100
    python -m loadtest --url http://127.0.0.1:8000 --scenario goodput_search --search step_seconds=10
    python -m loadtest --replay DUMP_DIR --url http://127.0.0.1:8000 --speed 2   # a --dump-requests dump

Writes one results folder: Locust's CSV and HTML, records.jsonl, plan.json, the
/metrics scrapes, summary.json, report.txt and PNG plots.  A goodput search (a scenario
with `search:`, or any scenario given --search) finds the highest load at which the
goodput SLO (dashboards/slo.yaml's TTFT/TPOT, or --goodput) holds for the objective's
share of requests.  `--replay DIR` sends the requests of a flight-recorder dump
(`sightline serve --dump-requests DIR`) at their recorded arrival offsets ÷ `--speed` and
reports recorded vs replayed latencies (loadtest/replay/).  Exit code: 0 the SLO gate
passed (a replay: every request was sent), 1 it failed, 2 bad arguments or config, 3 the
run itself failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.config import DEFAULT_CONFIG, Config, ConfigError, Plan, Scenario, Shape, parse_mix
from loadtest.gate import check_keys, parse_pairs, parse_slo_args
from loadtest.reconcile import scrape, scrape_settled
from loadtest.run import analyse, run_locust, save_scrape, stamp, warm_up
from loadtest.search import run_search
from loadtest.server import REPO, facts, target

EXIT_PASS, EXIT_GATE, EXIT_USAGE, EXIT_RUN = 0, 1, 2, 3
DEFAULT_MODEL = "smollm2-135m"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", help="test this running server instead of starting one")
    ap.add_argument("--model", help="model of the local server [smollm2-135m; a replay: the dump's]")
    ap.add_argument("--port", type=int, default=0, help="port of the local server [a free one]")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for the local server, e.g. --server-arg=--max-running-requests=32",
    )
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="workloads and scenarios (YAML)")
    ap.add_argument("--scenario", default="default", help="scenario in the config [default]")
    ap.add_argument("--mix", help="override the workload mix: chat=3,fixed=1")
    ap.add_argument("--arrival", choices=("closed", "poisson"), help="override the arrival mode")
    ap.add_argument("--levels", help="override the shape's levels: users (closed) or req/s (poisson), 1,8,32")
    ap.add_argument("--stage-seconds", type=float, help="override how long each level (a search: each step) is held")
    ap.add_argument(
        "--goodput",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="goodput SLO over dashboards/slo.yaml's and the config's: ttft_ms=500, tpot_ms=50, "
        "e2e_ms=10000, objective=0.95",
    )
    ap.add_argument(
        "--search",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run a goodput search (over the scenario's search: block): start=1, factor=2, "
        "max_level=64, max_steps=8, step_seconds=20, precision=0.1",
    )
    ap.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="gate threshold (adds to the config's): ttft_p99_ms=500, error_rate=0, goodput_min=1",
    )
    ap.add_argument(
        "--require-reconcile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fail the gate when client and server counts differ [on for a local server]",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-in-flight", type=int, default=512, help="Poisson: most open requests")
    ap.add_argument(
        "--failure-backoff",
        type=float,
        default=1.0,
        help="closed loop: seconds a user waits after a failed request [1]",
    )
    ap.add_argument("--out", type=Path, help="results folder [results/loadtest/<scenario>-<time>]")
    ap.add_argument(
        "--gate-only",
        type=Path,
        metavar="DIR",
        help="judge a finished run's folder again with these --slo values; sends nothing",
    )
    rp = ap.add_argument_group("replay a recorded dump (loadtest/replay/)")
    rp.add_argument(
        "--replay",
        type=Path,
        metavar="DIR",
        help="send the requests of a --dump-requests directory (or one requests-*.jsonl) at their "
        "recorded arrival offsets; the scenario options do not apply",
    )
    rp.add_argument("--speed", type=float, default=1.0, help="replay: divide the recorded offsets by this [1]")
    rp.add_argument(
        "--replay-max-tokens",
        choices=("exact", "recorded"),
        default="exact",
        help="replay: exact = the recorded completion_tokens with ignore_eos (same output lengths); "
        "recorded = the recorded max_new_tokens, ignore_eos and stop strings [exact]",
    )
    rp.add_argument(
        "--include-refused",
        action="store_true",
        help="replay: also send the requests the server shed (429) or refused as unavailable (503)",
    )
    rp.add_argument(
        "--replay-users",
        type=int,
        default=0,
        help="replay: Locust users [enough for the recorded overlap, see loadtest/replay/run.py]",
    )
    rp.add_argument("--tokenizer", help="replay: tokenizer for synthetic prompts, a model spec [the served model]")
    rp.add_argument("--request-timeout", type=float, default=300.0, help="replay: seconds per request [300]")
    return ap.parse_args(argv)


def build_scenario(a: argparse.Namespace, config: Config) -> Scenario:
    mix = parse_mix(a.mix) if a.mix else None
    raw = config.scenarios.get(a.scenario) or {}
    goodput = {**(raw.get("goodput") or {}), **parse_pairs(a.goodput, "--goodput")} if a.goodput else None
    search = None
    if a.search or "search" in raw:
        search = {**(raw.get("search") or {}), **parse_pairs(a.search, "--search")}
        if a.levels:
            raise ConfigError("--levels: a goodput search chooses its own levels (use --search start=...)")
        if a.stage_seconds:
            search["step_seconds"] = a.stage_seconds
    base = config.scenario(a.scenario, mix=mix, arrival=a.arrival, goodput=goodput)
    levels = tuple(float(x) for x in a.levels.split(",")) if a.levels else base.shape.levels
    shape = Shape.from_dict(
        {"kind": "sweep", "levels": levels, "stage_seconds": a.stage_seconds or base.shape.stage_seconds}
    )
    return config.scenario(a.scenario, mix=mix, arrival=a.arrival, shape=shape, goodput=goodput, search=search)


def gate_only(a: argparse.Namespace) -> int:
    plan = Plan.from_json((a.gate_only / "plan.json").read_text())
    slo = {**plan.scenario.slo, **parse_slo_args(a.slo)}
    outcome = analyse(a.gate_only, plan, slo, bool(a.require_reconcile), {}, write=False)
    print(outcome.text)
    return EXIT_PASS if outcome.passed else EXIT_GATE


def run(a: argparse.Namespace, config: Config, scenario: Scenario, slo: dict[str, float]) -> int:
    out = a.out or REPO / "results" / "loadtest" / f"{scenario.name}-{stamp()}"
    if (out / "records.jsonl").exists():
        raise ConfigError(f"{out} already holds a run; give another --out")
    out.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        url, server = target(a.url, a.model or DEFAULT_MODEL, a.port, out / "server.log", a.server_arg)
        f = facts(url)
        plan = Plan(
            url,
            f.model,
            scenario,
            [config.workloads[w].resolve(f.max_model_len) for w in scenario.mix],
            str(out / "records.jsonl"),
            a.seed,
            a.max_in_flight,
            a.failure_backoff,
        )
        (out / "plan.json").write_text(plan.to_json())
        warm_up(plan)
        before = scrape(url)
        save_scrape(before, out / "metrics_before.txt")
        started = time.time()
        if scenario.search:
            se = scenario.search
            print(
                f"goodput search {scenario.name}: {scenario.arrival}, from {se.start:g} ×{se.factor:g} "
                f"then bisection, ≤ {se.max_steps} steps × {se.step_seconds:g} s, goodput SLO "
                f"{scenario.goodput or 'none'} for ≥ {se.objective:.1%}, mix {scenario.mix} against {url}",
                flush=True,
            )
            rc = run_search(plan, out, run_locust)
        else:
            print(
                f"running {scenario.name}: {scenario.arrival}, levels {list(scenario.shape.levels)} × "
                f"{scenario.shape.stage_seconds:g} s, mix {scenario.mix} against {url}",
                flush=True,
            )
            rc = run_locust(plan, out)
        save_scrape(scrape_settled(url, f.model) if before else None, out / "metrics_after.txt")
    except (OSError, RuntimeError, TimeoutError, httpx.HTTPError, subprocess.SubprocessError) as exc:
        print(f"error: {exc} (logs in {out})", file=sys.stderr)
        return EXIT_RUN
    finally:
        if server is not None:
            server.stop()
    if rc != 0:
        print(f"warning: locust exited with {rc}; see {out / 'locust.log'}", file=sys.stderr)
    require = a.require_reconcile if a.require_reconcile is not None else server is not None
    info = {
        "url": url,
        "model": f.model,
        "local_server": server is not None,
        "scenario": scenario.name,
        "started_at": started,
        "locust_exit_code": rc,
        "cpus": os.cpu_count(),
        "slo": slo,
    }
    outcome = analyse(out, plan, slo, require, info)
    print(outcome.text)
    if not outcome.requests:
        print(f"error: no request was sent; see {out / 'locust.log'}", file=sys.stderr)
        return EXIT_RUN
    return EXIT_PASS if outcome.passed else EXIT_GATE


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        if a.gate_only:
            return gate_only(a)
        if a.replay:
            from loadtest.replay.run import run_replay

            return run_replay(a)
        config = Config.load(a.config)
        if not config.slo_spec_found:
            print(
                "note: dashboards/slo.yaml not found: no default goodput thresholds (set goodput: or --goodput)",
                file=sys.stderr,
            )
        scenario = build_scenario(a, config)
        slo = {**scenario.slo, **parse_slo_args(a.slo)}
        check_keys(slo)
        return run(a, config, scenario, slo)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
