"""Pipeline overhead: the same requests through HTTP+ZMQ+3 processes vs the engine in-process.

    .venv/bin/python loadtest/bench_http.py [--model smollm2-135m] [--concurrency 1,32] [--url URL]

For each concurrency N, N distinct `--prompt-len`-token prompts ask for exactly
`--gen-len` greedy tokens (EOS ignored), all at once.  In-process: `SchedulerCore`
stepped until idle, TTFT = add_request → first token sampled.  HTTP: streaming
`/v1/completions` against a server this script starts (or `--url`), TTFT = request
sent → first SSE chunk received.  Output tok/s = all output tokens ÷ wall time.
The engine runs first, then the server, so the two never share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.bench_engine import make_prompts  # noqa: E402
from loadtest.server import LocalServer  # noqa: E402
from serving.args import ServerArgs  # noqa: E402
from serving.engine.loader import load_model  # noqa: E402
from protocol.sampling_params import SamplingParams  # noqa: E402
from serving.engine.scheduler_core import SchedulerCore  # noqa: E402
from telemetry.clock import now_ns  # noqa: E402



def engine_run(model, prompts: list[list[int]], gen_len: int) -> dict:
    core = SchedulerCore(model, ServerArgs(model=model.name))
    params = SamplingParams(max_new_tokens=gen_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [core.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    events = core.run_to_completion()
    wall = time.perf_counter() - t0
    ttft = [(r.times.first_token - r.times.queued) / 1e6 for r in reqs]
    return {"ttft": ttft, "tok_s": sum(len(e.new_token_ids) for e in events) / wall, "wall": wall}


async def http_one(client: httpx.AsyncClient, ids: list[int], gen_len: int) -> tuple[float, int]:
    body = {"prompt": ids, "max_tokens": gen_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = now_ns()
    ttft, tokens, arrivals = None, 0, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                arrivals.append(now_ns())
                if ttft is None:
                    ttft = (arrivals[-1] - t0) / 1e6
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    itl = [(b - a) / 1e6 for a, b in zip(arrivals, arrivals[1:])]
    return ttft, tokens, itl


async def http_run(url: str, prompts: list[list[int]], gen_len: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(http_one(client, ids, gen_len) for ids in prompts))
        wall = time.perf_counter() - t0
    return {"ttft": [r[0] for r in res], "tok_s": sum(r[1] for r in res) / wall, "wall": wall,
            "itl": [g for r in res for g in r[2]]}


def cpu_seconds(url: str) -> dict[str, float]:
    """CPU seconds so far of each server process (main, scheduler, detokenizer), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["role"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "sightline_process_cpu_seconds_total"}


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                    help="a flag for the server this script starts, e.g. --server-arg=--dtype=bfloat16 (repeatable)")
    ap.add_argument("--skip-engine", action="store_true", help="only the HTTP pipeline")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    model = load_model(a.model)
    rows: dict[int, dict] = {n: {} for n in levels}
    if not a.skip_engine:
        engine_run(model, make_prompts(model, 2, a.prompt_len), 4)  # warm-up
        for n in levels:
            rows[n]["engine"] = engine_run(model, make_prompts(model, n, a.prompt_len), a.gen_len)
    prompts = {n: make_prompts(model, n, a.prompt_len) for n in levels}
    del model
    with tempfile.TemporaryDirectory() as tmp:
        server = None if a.url else LocalServer(a.model, a.port, Path(tmp) / "server.log",
                                                     ["--log-level", "warning", *a.server_arg])
        url = a.url or server.url
        try:
            asyncio.run(http_run(url, prompts[levels[0]][:2], 4))  # warm-up
            for n in levels:
                before = cpu_seconds(url)
                rows[n]["http"] = r = asyncio.run(http_run(url, prompts[n], a.gen_len))
                after, tokens = cpu_seconds(url), r["tok_s"] * r["wall"]
                r["cpu_per_1k"] = {role: 1000 * (after[role] - before.get(role, 0.0)) / tokens for role in after}
        finally:
            if server is not None:
                server.stop()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"model": a.model, "server_args": a.server_arg, "prompt_len": a.prompt_len,
                                      "gen_len": a.gen_len, "levels": rows}, indent=1))
    print(f"model {a.model}, prompt {a.prompt_len} tokens, {a.gen_len} new tokens per request, "
          f"{os.cpu_count()} CPUs, server flags: {' '.join(a.server_arg) or '(defaults)'}\n")
    print("| concurrency | path | TTFT p50 ms | TTFT max ms | ITL p50 ms | ITL p99 ms | output tok/s | wall s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in levels:
        for path in rows[n]:
            r = rows[n][path]
            print(f"| {n} | {'in-process engine' if path == 'engine' else 'HTTP + ZMQ pipeline'} | "
                  f"{statistics.median(r['ttft']):.0f} | {max(r['ttft']):.0f} | {_pct(r.get('itl', []), 0.5):.1f} | "
                  f"{_pct(r.get('itl', []), 0.99):.1f} | {r['tok_s']:.1f} | {r['wall']:.1f} |")
        cpu = rows[n]["http"]["cpu_per_1k"]
        print(f"| {n} | CPU s per 1000 output tokens | " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()))
              + " | | | | | |")
        if "engine" not in rows[n]:
            continue
        e, h = rows[n]["engine"], rows[n]["http"]
        print(f"| {n} | overhead | {statistics.median(h['ttft']) - statistics.median(e['ttft']):+.0f} | | | | "
              f"{100 * (h['tok_s'] / e['tok_s'] - 1):+.1f}% | |")


if __name__ == "__main__":
    main()
