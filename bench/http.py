"""Pipeline overhead: the same requests through HTTP+ZMQ+3 processes vs the engine in-process.

    .venv/bin/python -m bench.http [--model smollm2-135m] [--concurrency 1,32] [--url URL]

For each concurrency N, N distinct `--prompt-len`-token prompts ask for exactly
`--gen-len` greedy tokens (EOS ignored), all at once.  In-process: `SchedulerCore`
stepped until idle, TTFT = add_request → first token sampled.  HTTP: streaming
`/v1/completions` against a server this script starts (or `--url`), TTFT = request
sent → first SSE chunk with text received, ITL = gaps between such chunks.  Output
tok/s = all output tokens ÷ wall time.  The engine runs first, then the server, so the two
never share the CPU.  `run_levels` drives the same workload at any OpenAI-compatible server
(bench/peers.py points it at transformers and llama.cpp).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

from loadtest.server import LocalServer
from telemetry.clock import now_ns



def engine_run(model, prompts: list[list[int]], gen_len: int) -> dict:
    # The engine is imported here: the HTTP client half of this module (bench.peers, bench.table) needs no torch.
    from protocol.sampling_params import SamplingParams
    from serving.args import ServerArgs
    from serving.engine.scheduler_core import SchedulerCore

    core = SchedulerCore(model, ServerArgs(model=model.name))
    params = SamplingParams(max_new_tokens=gen_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [core.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    events = core.run_to_completion()
    wall = time.perf_counter() - t0
    ttft = [(r.times.first_token - r.times.queued) / 1e6 for r in reqs]
    return {"ttft": ttft, "tok_s": sum(len(e.new_token_ids) for e in events) / wall, "wall": wall}


# EOS is ignored so every request generates exactly max_tokens; each server has its own field for
# that (bench.peers passes theirs), the rest of the body is the same for every server.
SIGHTLINE_IGNORE_EOS = {"ignore_eos": True}


def completion_body(prompt: list[int] | str, gen_len: int, model: str | None = None,
                    extra: dict | None = None) -> dict:
    """A streaming greedy `/v1/completions` request for exactly `gen_len` tokens."""
    body = {"prompt": prompt, "max_tokens": gen_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    return {**body, **(SIGHTLINE_IGNORE_EOS if extra is None else extra)}


def _chunk_text(chunk: dict) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])


async def http_one(client: httpx.AsyncClient, ids: list[int] | str, gen_len: int, model: str | None = None,
                   extra: dict | None = None) -> tuple[float, int, list[float], bool]:
    """(TTFT ms, output tokens, inter-token gaps ms, whether the server reported usage).

    A token arrives with each SSE chunk that carries text; TTFT is request sent to the first
    such chunk.  Output tokens are the server's `usage.completion_tokens`, or, from a server
    that reports no usage while streaming, the number of text chunks."""
    t0 = now_ns()
    ttft, tokens, arrivals = None, None, []
    async with client.stream("POST", "/v1/completions", json=completion_body(ids, gen_len, model, extra)) as r:
        if r.is_error:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:300]}")
            if _chunk_text(chunk):
                arrivals.append(now_ns())
                if ttft is None:
                    ttft = (arrivals[-1] - t0) / 1e6
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if ttft is None:
        raise RuntimeError("the stream ended without any text")
    itl = [(b - a) / 1e6 for a, b in zip(arrivals, arrivals[1:])]
    return ttft, len(arrivals) if tokens is None else tokens, itl, tokens is not None


async def http_run(url: str, prompts: list[list[int]] | list[str], gen_len: int, model: str | None = None,
                   extra: dict | None = None) -> dict:
    """All `prompts` at once; output tok/s = all output tokens ÷ wall time."""
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(http_one(client, p, gen_len, model, extra) for p in prompts))
        wall = time.perf_counter() - t0
    return {"ttft": [r[0] for r in res], "tok_s": sum(r[1] for r in res) / wall, "wall": wall,
            "itl": [g for r in res for g in r[2]], "tokens": sum(r[1] for r in res),
            "tokens_from": "usage" if all(r[3] for r in res) else "text chunks"}


def level_prompts(model, levels: list[int], prompt_len: int) -> dict[int, list[list[int]]]:
    """Each level's prompts (`model` needs only `.tokenizer`), disjoint from every other level's:
    no server (our prefix cache, llama.cpp's reuse of its previous sequence) meets a prompt it
    has computed before, so every level pays its whole prefill."""
    from bench.engine import make_prompts

    out, start = {}, 0
    for n in levels:
        out[n], start = make_prompts(model, n, prompt_len, start=start), start + n
    return out


def run_levels(url: str, prompts: dict[int, list], gen_len: int, model: str | None = None, extra: dict | None = None,
               cpu_probe: Callable[[], dict[str, float]] | None = None) -> dict[int, dict]:
    """bench.http's workload against any OpenAI-compatible server at `url`: a 2-request warm-up,
    then for each concurrency N (the keys of `prompts`) its N prompts all at once.  The warm-up
    sends the first prompts reversed, so that no server (prefix cache, llama.cpp's reuse of the
    previous sequence) starts a level with its prompt already computed.  With `cpu_probe` (our
    /metrics), also CPU seconds per 1,000 output tokens per process."""
    first = next(iter(prompts.values()))
    asyncio.run(http_run(url, [p[::-1] for p in first[:2]], 4, model, extra))  # warm-up
    rows = {}
    for n, ps in prompts.items():
        before = cpu_probe() if cpu_probe else None
        rows[n] = r = asyncio.run(http_run(url, ps, gen_len, model, extra))
        if cpu_probe:
            after = cpu_probe()
            r["cpu_per_1k"] = {role: 1000 * (after[role] - before.get(role, 0.0)) / r["tokens"] for role in after}
    return rows


def summary(r: dict) -> dict:
    """The table's numbers from one level's raw result (engine or HTTP)."""
    return {"ttft_p50_ms": statistics.median(r["ttft"]), "ttft_max_ms": max(r["ttft"]),
            "itl_p50_ms": _pct(r.get("itl", []), 0.5), "itl_p99_ms": _pct(r.get("itl", []), 0.99),
            "tok_s": r["tok_s"], "wall_s": r["wall"]}


TABLE_HEAD = ("| concurrency | path | TTFT p50 ms | TTFT max ms | ITL p50 ms | ITL p99 ms | output tok/s | wall s |\n"
              "|---:|---|---:|---:|---:|---:|---:|---:|")


def table_row(n: int, path: str, r: dict) -> str:
    s = summary(r)
    return (f"| {n} | {path} | {s['ttft_p50_ms']:.0f} | {s['ttft_max_ms']:.0f} | {s['itl_p50_ms']:.1f} | "
            f"{s['itl_p99_ms']:.1f} | {s['tok_s']:.1f} | {s['wall_s']:.1f} |")


def cpu_seconds(url: str) -> dict[str, float]:
    """CPU seconds so far of each server process (main, scheduler, detokenizer), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["role"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "sightline_process_cpu_seconds_total"}


def engine_info(url: str) -> dict[str, str]:
    """What the server's engine computes in (`sightline_engine_info` labels: dtype, quantization)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return next(({k: s.labels[k] for k in ("dtype", "quantization")} for fam in text_string_to_metric_families(text)
                 for s in fam.samples if s.name == "sightline_engine_info"), {})


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    from bench.engine import make_prompts
    from serving.engine.loader import load_model

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
    prompts = level_prompts(model, levels, a.prompt_len)
    if not a.skip_engine:
        engine_run(model, make_prompts(model, 2, a.prompt_len, start=sum(levels)), 4)  # warm-up
        for n in levels:
            rows[n]["engine"] = engine_run(model, prompts[n], a.gen_len)
    del model
    with tempfile.TemporaryDirectory() as tmp:
        server = None if a.url else LocalServer(a.model, a.port, Path(tmp) / "server.log",
                                                     ["--log-level", "warning", *a.server_arg])
        url = a.url or server.url
        try:
            for n, r in run_levels(url, prompts, a.gen_len, cpu_probe=lambda: cpu_seconds(url)).items():
                rows[n]["http"] = r
            info = engine_info(url)
        finally:
            if server is not None:
                server.stop()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"model": a.model, "server_args": a.server_arg, "engine_info": info,
                                      "prompt_len": a.prompt_len, "gen_len": a.gen_len, "levels": rows}, indent=1))
    print(f"model {a.model}, prompt {a.prompt_len} tokens, {a.gen_len} new tokens per request, "
          f"{os.cpu_count()} CPUs, server flags: {' '.join(a.server_arg) or '(defaults)'}, engine: "
          f"{' '.join(f'{k}={v}' for k, v in info.items()) or '?'}\n")
    print(TABLE_HEAD)
    for n in levels:
        for path in rows[n]:
            print(table_row(n, "in-process engine" if path == "engine" else "HTTP + ZMQ pipeline", rows[n][path]))
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
