"""Front-end scale-out: tokenizer workers (front-end capacity) and data-parallel Scheduler ranks (output tok/s).

    .venv/bin/python -m bench.frontend [--parts capacity,dp] [--repeats 3] [--json PATH]

(capacity) `--tokenizer-workers A,B` (default 1,2) front-end processes, `--capacity-model`
(tiny-random: the engine costs little, the front end is what is measured), `--dp-size 1`.
A client in a process of its own (`--client-procs` of them; raw keep-alive HTTP/1.1, not httpx,
so it stays light) keeps `--capacity-concurrency` non-streaming `/v1/completions` requests in
flight, each on its own connection, each a prompt of a few words and
`max_tokens: 1` (EOS ignored), for `--warmup` seconds and then `--duration` seconds more.
Over that window: requests/s = requests completed in it ÷ its length; latency p50/p99 of
those requests (sent → whole response read); errors (non-200 answers, transport errors).
Front-end CPU % = CPU seconds of the front-end processes, from two /metrics scrapes
(`sightline_process_cpu_seconds_total`) at the window's edges, ÷ the wall time between
the scrapes × 100: role `main` with one worker; with several, the `worker-*` roles summed
and the hub (`main`) shown on its own.  100 % = one core.  The client's CPU % (getrusage
of its own process over the window) is printed too: it shares the machine's cores with
the server, so when it is near 100 % × client processes the client, not the server, may be
the limit.  The CPU % of everything else (the machine's busy CPU less the server's and the
client's) is printed as well: anything else running skews every number.

(dp) `--dp-sizes A,B` (default 1,2) Scheduler ranks, `--dp-model` (smollm2-135m), one
tokenizer worker.  bench.http's workload (bench/common.py's `run_levels`: a 2-request warm-up, then
`--concurrency` distinct `--prompt-len`-token prompts asking for exactly `--gen-len` greedy
tokens each, EOS ignored, all at once, streaming): output tok/s = all output tokens ÷ wall
time, TTFT p50, ITL p50/p99; every run uses the same prompts.  CPU % of the server, of
this script (the client) and of everything else over the level, as above.

Each run starts its own server and stops it before the next, so no two share the CPU;
`--repeats` R runs per setting, alternating them (A B A B …).  Printed per part: each run,
then mean (min–max) per setting and the ratio of the means B/A.  All raw numbers go to
`--json` (results/bench/frontend.json).  A benchmark prints numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

import psutil

from bench.common import cpu_seconds, make_prompts, run_levels, start_server, summary, write_json
from bench.frontend_client import client_main, own_cpu_seconds
from loadtest.stats import Percentiles
from serving.model_files import load_tokenizer

# -- pure logic (tests/unit/test_bench_frontend.py) ----------------------------------------------


def role_cpu_percent(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """CPU % (100 = one core) of each process role between two scrapes of
    `sightline_process_cpu_seconds_total` `wall_s` apart.  A role whose counter went down
    (its process was replaced) counts its new process's seconds only; a role missing from
    `after` (its process is gone) is left out."""
    if wall_s <= 0:
        raise ValueError("the scrapes must be apart in time")
    out = {}
    for role, t in after.items():
        delta = t - before.get(role, 0.0)
        out[role] = 100.0 * (t if delta < 0 else delta) / wall_s
    return out


def front_end_cpu(per_role: dict[str, float]) -> dict[str, float | None]:
    """The front end's share of `role_cpu_percent`: `front` = the processes that answer HTTP
    (`main` when there is one front end; the `worker-*` roles summed when there are
    several), `hub` = `main` in the latter case (None with one front end), `engine` =
    Scheduler rank(s) and detokenizer, `total` = every role."""
    workers = [v for role, v in per_role.items() if role.startswith("worker-")]
    main = per_role.get("main", 0.0)
    return {
        "front": sum(workers) if workers else main,
        "hub": main if workers else None,
        "engine": sum(v for role, v in per_role.items() if role.startswith("scheduler") or role == "detokenizer"),
        "total": sum(per_role.values()),
    }


def other_cpu_percent(machine_pct: float, server_pct: float, client_pct: float) -> float:
    """CPU % of everything else on the machine (another job, this script's parent): the machine's
    busy CPU % less the server's and the client's, never below 0 (the readings are a few ms apart)."""
    return max(0.0, machine_pct - server_pct - client_pct)


def dp_cpu(marks: list[tuple[float, float, dict[str, float], float]]) -> dict:
    """A dp run's CPU % from the two marks taken right before and right after its level:
    (time, machine busy CPU s, CPU s per server role, this process's CPU s) each."""
    (t0, b0, before, c0), (t1, b1, after, c1) = marks
    per_role = role_cpu_percent(before, after, t1 - t0)
    server, client, machine = sum(per_role.values()), 100.0 * (c1 - c0) / (t1 - t0), 100.0 * (b1 - b0) / (t1 - t0)
    return {
        "role_cpu_pct": per_role,
        "server_cpu_pct": server,
        "client_cpu_pct": client,
        "machine_cpu_pct": machine,
        "other_cpu_pct": other_cpu_percent(machine, server, client),
    }


def spread(values: list[float | None]) -> dict[str, float] | None:
    """mean, min, max, n of the values that exist (None and NaN left out); None if none do."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return None
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _cell(s: dict | None, fmt: str) -> str:
    if s is None:
        return "–"
    if s["n"] == 1 or s["min"] == s["max"]:
        return format(s["mean"], fmt)
    return f"{s['mean']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def ratio(a: dict | None, b: dict | None) -> float | None:
    """B/A of the means; None where either is missing or A's mean is 0."""
    return None if a is None or b is None or a["mean"] == 0 else b["mean"] / a["mean"]


def run_line(run: dict, metrics: list[tuple[str, str, str]]) -> str:
    """One run's numbers, `title value` for each (key, title, format) in `metrics`."""
    return ", ".join(f"{title} {'–' if run.get(key) is None else format(run[key], fmt)}" for key, title, fmt in metrics)


def ratio_table(
    label_a: str, label_b: str, runs_a: list[dict], runs_b: list[dict], metrics: list[tuple[str, str, str]]
) -> str:
    """A markdown table: one row per (key, title, format) in `metrics`, the key's values over
    `runs_a` and `runs_b` as mean (min–max), and B/A of the means."""
    lines = [f"| metric | {label_a} | {label_b} | B/A |", "|---|---:|---:|---:|"]
    for key, title, fmt in metrics:
        a, b = spread([r.get(key) for r in runs_a]), spread([r.get(key) for r in runs_b])
        q = ratio(a, b)
        lines.append(f"| {title} | {_cell(a, fmt)} | {_cell(b, fmt)} | {'–' if q is None else f'{q:.2f}'} |")
    return "\n".join(lines)


def alternate(a, b, repeats: int) -> list:
    """A B A B …: `repeats` of each."""
    return [x for _ in range(repeats) for x in (a, b)]


def capacity_numbers(clients: list[dict], cpu: dict[str, float | None], duration_s: float, machine_pct: float) -> dict:
    """One capacity run's row from its client processes' results, `front_end_cpu` and the
    machine's busy CPU % over the window."""
    lat = [x for c in clients for x in c["latency_s"]]
    p = Percentiles.of(lat)
    done, cpu_s = len(lat), sum(c["cpu_s"] for c in clients)
    errors = Counter()
    for c in clients:
        errors.update(c["errors"])
    req_s = done / duration_s
    return {
        "req_s": req_s,
        "completed": done,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "p50_ms": p.p50,
        "p99_ms": p.p99,
        "front_cpu_pct": cpu["front"],
        "hub_cpu_pct": cpu["hub"],
        "engine_cpu_pct": cpu["engine"],
        "server_cpu_pct": cpu["total"],
        # CPU % ÷ 100 × 1000 ms per second of wall time ÷ requests per second
        "front_cpu_ms_per_req": 10.0 * cpu["front"] / req_s if req_s else None,
        "client_cpu_pct": 100.0 * cpu_s / duration_s,
        "machine_cpu_pct": machine_pct,
        "other_cpu_pct": other_cpu_percent(machine_pct, cpu["total"], 100.0 * cpu_s / duration_s),
    }


CAPACITY_METRICS = [
    ("req_s", "requests/s", ".1f"),
    ("p50_ms", "latency p50 ms", ".1f"),
    ("p99_ms", "latency p99 ms", ".1f"),
    ("errors", "errors", ".0f"),
    ("front_cpu_pct", "front-end CPU % (main, or workers summed)", ".0f"),
    ("hub_cpu_pct", "hub CPU % (main, several workers only)", ".0f"),
    ("front_cpu_ms_per_req", "front-end CPU ms per request", ".2f"),
    ("engine_cpu_pct", "scheduler + detokenizer CPU %", ".0f"),
    ("server_cpu_pct", "server CPU % (all roles)", ".0f"),
    ("client_cpu_pct", "client CPU % (all client processes)", ".0f"),
    ("other_cpu_pct", "other processes' CPU % (should be ~0)", ".0f"),
]
DP_METRICS = [
    ("tok_s", "output tok/s", ".1f"),
    ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
    ("itl_p50_ms", "ITL p50 ms", ".1f"),
    ("itl_p99_ms", "ITL p99 ms", ".1f"),
    ("wall_s", "wall s", ".1f"),
    ("server_cpu_pct", "server CPU %", ".0f"),
    ("client_cpu_pct", "client CPU % (this script)", ".0f"),
    ("other_cpu_pct", "other processes' CPU % (should be ~0)", ".0f"),
]

# -- (capacity) the run: client processes (bench/frontend_client.py), /metrics at the edges ---------


def machine_busy_seconds() -> float:
    """CPU seconds all processes on this machine have used, all cores together (steal not counted)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _scrape(url: str) -> tuple[float, float, dict[str, float]]:
    """(time.time() halfway through the scrape, the machine's busy CPU seconds then, CPU seconds per role)."""
    t0, b0 = time.time(), machine_busy_seconds()
    cpu = cpu_seconds(url)
    return (t0 + time.time()) / 2, (b0 + machine_busy_seconds()) / 2, cpu


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def capacity_run(url: str, concurrency: int, client_procs: int, warmup_s: float, duration_s: float) -> dict:
    """Clients started, warmed up for `warmup_s`, measured for `duration_s`; /metrics scraped at
    the window's edges."""
    ctx = mp.get_context("spawn")
    ready, results, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    shares = [concurrency // client_procs + (k < concurrency % client_procs) for k in range(client_procs)]
    procs = [
        ctx.Process(
            target=client_main, daemon=True, args=(url, n, sum(shares[:k]), ready, go, start_at, duration_s, results)
        )
        for k, n in enumerate(shares)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        start_at.value = time.time() + warmup_s
        go.set()
        _sleep_until(start_at.value)
        t0, busy0, before = _scrape(url)
        _sleep_until(start_at.value + duration_s)
        t1, busy1, after = _scrape(url)
        clients = [results.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    per_role = role_cpu_percent(before, after, t1 - t0)
    row = capacity_numbers(clients, front_end_cpu(per_role), duration_s, 100.0 * (busy1 - busy0) / (t1 - t0))
    row.update(
        role_cpu_pct=per_role,
        scrape_interval_s=t1 - t0,
        client_cpu_s=[c["cpu_s"] for c in clients],
        latency_ms=[round(1000 * x, 3) for c in clients for x in c["latency_s"]],
    )
    return row


# -- the runs ------------------------------------------------------------------------------------


def run_capacity(a: argparse.Namespace, tmp: Path) -> dict:
    runs = []
    for k, n in enumerate(alternate(*a.tokenizer_workers, a.repeats)):
        flags = ["--tokenizer-worker-num", str(n), "--dp-size", "1", *a.server_arg]
        server = start_server(a.capacity_model, a.port, tmp / f"capacity-{k}.log", flags)
        try:
            r = capacity_run(server.url, a.capacity_concurrency, a.client_procs, a.warmup, a.duration)
        finally:
            server.stop()
        r.update(tokenizer_workers=n, run=k)
        runs.append(r)
        print(
            f"capacity run {k}, {n} tokenizer worker(s): {run_line(r, CAPACITY_METRICS)}"
            + "".join(f"; {kind} ×{m}" for kind, m in sorted(r["error_kinds"].items())),
            flush=True,
        )
    return {
        "model": a.capacity_model,
        "concurrency": a.capacity_concurrency,
        "client_procs": a.client_procs,
        "warmup_s": a.warmup,
        "duration_s": a.duration,
        "settings": a.tokenizer_workers,
        "runs": runs,
    }


def run_dp(a: argparse.Namespace, tmp: Path) -> dict:
    tok, _ = load_tokenizer(a.dp_model)
    prompts = make_prompts(types.SimpleNamespace(tokenizer=tok), a.concurrency, a.prompt_len)  # needs .tokenizer only
    runs = []
    for k, d in enumerate(alternate(*a.dp_sizes, a.repeats)):
        flags = ["--tokenizer-worker-num", "1", "--dp-size", str(d), *a.server_arg]
        server = start_server(a.dp_model, a.port, tmp / f"dp-{k}.log", flags)
        try:
            marks: list[tuple[float, float, dict[str, float], float]] = []

            def probe() -> dict[str, float]:  # run_levels calls it right before and right after the level
                marks.append(_scrape(server.url) + (own_cpu_seconds(),))
                return marks[-1][2]

            raw = run_levels(server.url, {a.concurrency: prompts}, a.gen_len, cpu_probe=probe)
        finally:
            server.stop()
        r = {**summary(raw[a.concurrency]), **dp_cpu(marks), "dp_size": d, "run": k, "raw": raw[a.concurrency]}
        runs.append(r)
        print(f"dp run {k}, dp-size {d}: {run_line(r, DP_METRICS)}", flush=True)
    return {
        "model": a.dp_model,
        "concurrency": a.concurrency,
        "prompt_len": a.prompt_len,
        "gen_len": a.gen_len,
        "settings": a.dp_sizes,
        "runs": runs,
    }


def _pair(text: str) -> list[int]:
    xs = [int(x) for x in text.split(",")]
    if len(xs) != 2:
        raise argparse.ArgumentTypeError("two settings, A,B")
    return xs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="capacity,dp", help="which parts to run: capacity, dp or both")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each setting, alternating A B A B …")
    ap.add_argument("--port", type=int, default=0, help="the servers' port (0: a free one)")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for every server this script starts, e.g. --server-arg=--dtype=float32 (repeatable)",
    )
    g = ap.add_argument_group("capacity")
    g.add_argument("--capacity-model", default="tiny-random")
    g.add_argument("--tokenizer-workers", type=_pair, default=[1, 2], metavar="A,B")
    g.add_argument("--capacity-concurrency", type=int, default=64, help="requests in flight")
    g.add_argument("--client-procs", type=int, default=1, help="client processes sharing those requests")
    g.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the measured window")
    g.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    g = ap.add_argument_group("dp")
    g.add_argument("--dp-model", default="smollm2-135m")
    g.add_argument("--dp-sizes", type=_pair, default=[1, 2], metavar="A,B")
    g.add_argument("--concurrency", type=int, default=64, help="requests, all sent at once")
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--gen-len", type=int, default=64, help="output tokens per request (EOS ignored)")
    ap.add_argument("--json", type=Path, default=Path("results/bench/frontend.json"), help="the raw numbers")
    a = ap.parse_args(argv)
    a.parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if not a.parts or set(a.parts) - {"capacity", "dp"}:
        ap.error("--parts: capacity, dp or capacity,dp")
    if a.repeats < 1 or a.duration <= 0 or a.warmup < 0 or not 1 <= a.client_procs <= a.capacity_concurrency:
        ap.error("--repeats ≥ 1, --duration > 0, --warmup ≥ 0, 1 ≤ --client-procs ≤ --capacity-concurrency")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    out: dict = {"cpus": os.cpu_count(), "server_args": a.server_arg, "repeats": a.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        if "capacity" in a.parts:
            out["capacity"] = run_capacity(a, Path(tmp))
        if "dp" in a.parts:
            out["dp"] = run_dp(a, Path(tmp))
    write_json(a.json, out)
    print(
        f"\n{os.cpu_count()} CPUs, {a.repeats} run(s) per setting, alternating; mean (min–max); "
        f"server flags: {' '.join(a.server_arg) or '(defaults)'}"
    )
    if "capacity" in out:
        c, (x, y) = out["capacity"], a.tokenizer_workers
        print(
            f"\n(capacity) {c['model']}, {c['concurrency']} non-streaming 1-token requests in flight from "
            f"{c['client_procs']} client process(es), {c['duration_s']:g} s measured after {c['warmup_s']:g} s; "
            f"CPU % of one core\n"
        )
        print(
            ratio_table(
                f"{x} tokenizer worker(s)",
                f"{y} tokenizer worker(s)",
                [r for r in c["runs"] if r["tokenizer_workers"] == x],
                [r for r in c["runs"] if r["tokenizer_workers"] == y],
                CAPACITY_METRICS,
            )
        )
    if "dp" in out:
        d, (x, y) = out["dp"], a.dp_sizes
        print(
            f"\n(dp) {d['model']}, {d['concurrency']} distinct {d['prompt_len']}-token prompts × {d['gen_len']} "
            f"tokens, all at once, streaming, 1 tokenizer worker\n"
        )
        print(
            ratio_table(
                f"dp-size {x}",
                f"dp-size {y}",
                [r for r in d["runs"] if r["dp_size"] == x],
                [r for r in d["runs"] if r["dp_size"] == y],
                DP_METRICS,
            )
        )
    print(f"\nraw numbers: {a.json}")


if __name__ == "__main__":
    main()
