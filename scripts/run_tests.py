#!/usr/bin/env python3
"""`make test`: every test, in three lanes side by side.

- the unit lane: `tests/unit` (pure computation: it fills the cores while the end-to-end lanes wait on
  timeouts, step floors and other processes; printed as soon as it ends, so a unit failure shows in minutes);
- the first lane: the end-to-end modules not marked `lane2`;
- the second lane: the modules marked `lane2` (tests/conftest.py): soak, chaos, replicas behind
  HAProxy, live alerting, Locust, the model-family and SmolLM2 servers, which mostly wait on fixed
  durations, Prometheus and other processes, and enough other e2e modules to end with the first.

Every server takes a free port of its own, so the lanes never collide.  Each lane's pytest output
goes to a log printed when the lane ends; then the 25 slowest tests of the whole run and one
closing line with the totals.  Exit status: non-zero when any lane failed.

Usage: python scripts/run_tests.py [--hostile] [pytest args...]
  --hostile  two lanes on one core (taskset -c 0; `make test-hostile`): the unit tests then the first lane,
             beside the second: how a timing-sensitive test behaves on the slowest machine, its engine steps
             slow and preempted by the other lane.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
STARTS_LOG_ENV = "SIGHTLINE_TEST_STARTS_LOG"  # tests/server_util.ServerProc appends one line a server start
CPU_LOG_ENV = "SIGHTLINE_TEST_CPU_LOG"  # tests/conftest.py appends each module's CPU seconds


def lane(
    name: str,
    runs: list[list[str]],
    logdir: Path,
    env: dict[str, str],
    prefix: list[str],
    results: dict,
    lock: threading.Lock,
) -> None:
    """Run `runs` (pytest argument lists) one after another; print each one's log as it ends."""
    for i, args in enumerate(runs):
        log, xml = logdir / f"{name}-{i}.log", logdir / f"{name}-{i}.xml"
        t0 = time.monotonic()
        with open(log, "wb") as out:
            rc = subprocess.call(
                [*prefix, PY, "-m", "pytest", *args, f"--junitxml={xml}"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        with lock:
            results[(name, i)] = (rc, xml, time.monotonic() - t0)
            print(
                f"\n===== {name} lane, part {i + 1}: pytest {' '.join(args)} (exit {rc}, "
                f"{time.monotonic() - t0:.0f} s) =====",
                flush=True,
            )
            sys.stdout.write(log.read_text(errors="replace"))
            sys.stdout.flush()


def summary(xmls: list[Path]) -> tuple[dict[str, int], list[tuple[float, str]]]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    times: list[tuple[float, str]] = []
    for xml in xmls:
        if not xml.exists():
            counts["errors"] += 1
            continue
        for case in ET.parse(xml).getroot().iter("testcase"):
            times.append((float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}"))
            tags = {c.tag for c in case}
            if "failure" in tags:
                counts["failed"] += 1
            elif "error" in tags:
                counts["errors"] += 1
            elif "skipped" in tags:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return counts, sorted(times, reverse=True)


def starts_summary(path: Path, top: int = 10) -> list[str]:
    """Server starts are the suite's biggest fixed cost: how many, how long, and the modules with most."""
    if not path.exists():
        return ["no test server was started"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_module: dict[str, list[float]] = {}
    for row in rows:
        by_module.setdefault(row["test"].split("::")[0], []).append(row["seconds"])
    lines = [f"{len(rows)} test server starts, {sum(r['seconds'] for r in rows):.0f} s until healthy in all; most:"]
    for module, secs in sorted(by_module.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(secs):8.1f}s  {len(secs):3d}  {module}")
    return lines


def cpu_summary(path: Path, top: int = 15) -> list[str]:
    """On 2 cores the run lasts about its CPU time over two: the modules that spend most of it."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    lines = [f"{sum(r['cpu'] for r in rows):.0f} CPU seconds in {len(rows)} modules (their servers included); most:"]
    lines += [f"{r['cpu']:8.1f}s  {r['module']}" for r in sorted(rows, key=lambda r: -r["cpu"])[:top]]
    return lines


def main(argv: list[str]) -> int:
    hostile = "--hostile" in argv
    extra = [a for a in argv if a != "--hostile"]
    logdir = Path(tempfile.mkdtemp(prefix="sightline-tests-"))
    starts = logdir / "server-starts.jsonl"
    cpu = logdir / "module-cpu.jsonl"
    env = {**os.environ, STARTS_LOG_ENV: str(starts), CPU_LOG_ENV: str(cpu)}
    prefix = ["taskset", "-c", "0"] if hostile else []
    common = ["-p", "no:cacheprovider", *extra]
    # the unit tests compute (SmolLM2 beside transformers, 200-request engine runs: up to ~70 s alone, more
    # beside the other lanes): 300 s each; an e2e test that passes 120 s has hung
    unit = ["tests/unit", "--timeout=300", *common]
    first, second = ["tests/e2e", "-m", "not lane2", *common], ["tests/e2e", "-m", "lane2", *common]
    lanes = (
        {"first": [unit, first], "second": [second]}
        if hostile
        else {"unit": [unit], "first": [first], "second": [second]}
    )
    results: dict = {}
    lock = threading.Lock()
    t0 = time.monotonic()
    threads = [threading.Thread(target=lane, args=(n, r, logdir, env, prefix, results, lock)) for n, r in lanes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts, times = summary([xml for _, xml, _ in results.values()])
    print(
        f"\n===== the 25 slowest tests of the run ({time.monotonic() - t0:.0f} s in all"
        f"{', hostile: one core' if hostile else ''}) ====="
    )
    for seconds, name in times[:25]:
        print(f"{seconds:8.2f}s  {name}")
    print("\n===== " + "\n".join(starts_summary(starts)))
    print("\n===== " + "\n".join(cpu_summary(cpu)))
    # pytest exit 5 (no tests collected) is a failure here: every lane has tests
    failed = [f"{n} part {i + 1} (exit {rc})" for (n, i), (rc, _, _) in sorted(results.items()) if rc != 0]
    if failed:
        print("failed lanes: " + ", ".join(failed))
    line = f"{counts['passed']} passed, {counts['failed'] + counts['errors']} failed, {counts['skipped']} skipped"
    print(line)
    return 1 if failed or counts["failed"] or counts["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
