"""Concurrency reached and output tok/s of streaming chat clients with and without max_tokens, per
admission policy (see docs/engine.md, "Admission and retraction").

    .venv/bin/python -m bench.admission [--model smollm2-135m] [--clients 16] [--seconds 30] [--quick]
                                        [--policies estimate,reserve] [--json PATH]

For each policy a server starts with default flags (but `--admission POLICY`, float32) and
`--clients` closed-loop clients stream chat completions for `--seconds` in three phases:
all without max_tokens (the openai client's default), all with max_tokens 128, and half of
each in the same run.  A client that finishes starts its next request at once; at the end
every stream is cut (the server aborts them).  Per phase and group: requests running at
once in the engine (peak and mean of `sightline_num_requests_running`, sampled every
0.25 s), output tokens per second (every streamed token, finished or cut), 429s, and the
engine's retractions and recomputed tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import start_server, write_json

PHASES = {"without": 1.0, "with": 0.0, "mixed": 0.5}  # the share of clients that set no max_tokens
MAX_TOKENS = 128
QUESTIONS = [
    "Explain how a lighthouse works.",
    "Write a story about a cat who learns to sail.",
    "Describe the water cycle to a child.",
    "What makes bread rise?",
]


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def client_loop(client: httpx.AsyncClient, i: int, max_tokens: int | None, stop: float, tally: dict) -> None:
    n = 0
    while time.monotonic() < stop:
        body: dict = {
            "messages": [{"role": "user", "content": f"[{i}.{n}] {QUESTIONS[(i + n) % len(QUESTIONS)]}"}],
            "stream": True,
            "temperature": 0.7,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        n += 1
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 429:
                tally["429"] += 1
                await r.aread()
                await asyncio.sleep(0.5)
                continue
            last = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tally["tokens"] += usage["completion_tokens"] - last
                        last = usage["completion_tokens"]
        tally["requests"] += 1


async def phase(url: str, clients: int, share_without: float, seconds: float) -> dict:
    without = round(clients * share_without)
    groups = {
        "without": {"tokens": 0, "requests": 0, "429": 0, "clients": without},
        "with": {"tokens": 0, "requests": 0, "429": 0, "clients": clients - without},
    }
    before = scrape(url)
    running: list[float] = []
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=clients + 8)) as c:
        tasks = [
            asyncio.create_task(
                client_loop(
                    c, i, None if i < without else MAX_TOKENS, stop, groups["without" if i < without else "with"]
                )
            )
            for i in range(clients)
        ]
        t0 = time.monotonic()
        while time.monotonic() < stop:
            running.append((await asyncio.to_thread(scrape, url)).get("sightline_num_requests_running", 0.0))
            await asyncio.sleep(0.25)
        wall = time.monotonic() - t0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)  # the aborts reach the engine
    after = scrape(url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out = {
        "peak_running": max(running, default=0.0),
        "mean_running": statistics.fmean(running) if running else 0.0,
        "retractions": delta("sightline_retractions_total"),
        "retracted_tokens": delta("sightline_retracted_tokens_total"),
        "recomputed_tokens": delta("sightline_retraction_recomputed_tokens_total"),
        "seconds": wall,
    }
    for name, g in groups.items():
        if g["clients"]:
            out[name] = {**g, "tok_s": g["tokens"] / wall, "tok_s_per_client": g["tokens"] / wall / g["clients"]}
    return out


def rows(results: dict) -> list[str]:
    lines = [
        "| policy | phase | peak running | mean running | tok/s without max_tokens (per client) | "
        "tok/s with max_tokens (per client) | 429 | retractions (recomputed tokens) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, phases in results.items():
        for name, r in phases.items():

            def tok(g: str) -> str:
                return f"{r[g]['tok_s']:.1f} ({r[g]['tok_s_per_client']:.2f})" if g in r else "–"

            shed = sum(r[g]["429"] for g in ("without", "with") if g in r)
            lines.append(
                f"| {policy} | {name} | {r['peak_running']:.0f} | {r['mean_running']:.1f} | {tok('without')} "
                f"| {tok('with')} | {shed} | {r['retractions']:.0f} ({r['recomputed_tokens']:.0f}) |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30.0, help="per phase")
    ap.add_argument("--policies", default="estimate,reserve")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--quick", action="store_true", help="the mixed phase only, 15 s")
    ap.add_argument("--port", type=int, default=8400)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    phases = ["mixed"] if a.quick else a.phases.split(",")
    seconds = 15.0 if a.quick else a.seconds
    results: dict = {}
    for policy in a.policies.split(","):
        log = Path("results/bench") / f"admission-{policy}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        srv = start_server(a.model, a.port, log, ["--dtype", "float32", "--admission", policy])
        try:
            results[policy] = {p: asyncio.run(phase(srv.url, a.clients, PHASES[p], seconds)) for p in phases}
        finally:
            srv.stop()
    print("\n".join(rows(results)))
    if a.json:
        write_json(
            a.json,
            {"model": a.model, "clients": a.clients, "seconds": seconds, "max_tokens": MAX_TOKENS, "results": results},
        )


if __name__ == "__main__":
    main()
