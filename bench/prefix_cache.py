"""Prefix cache over HTTP: cold vs warm TTFT behind a shared system prompt, and what the
cache costs a workload that shares nothing.

    .venv/bin/python -m bench.prefix_cache [--model smollm2-135m] [--quick] [--json PATH]

(a) Cold vs warm.  Streaming `/v1/completions` requests with token ids: a
`--system-tokens`-token prefix (the `shared-prefix` load-test workload's system prompt,
encoded) and a `--user-tokens`-token user turn of their own, `--ttft-gen` tokens each.
Each of `--cold` rounds empties the cache (POST /flush_cache), sends one request (cold:
the whole prompt is prefilled), then `--warm` more one after another (warm: only the
user turn is).  TTFT = request sent → first text chunk (bench/common.py's `http_one`).  The
goal is warm p50 ≤ 1/5 of cold p50.  /metrics says how many prompt tokens were reused.

(b) A/B with nothing shared.  `--ab-requests` prompts of `--prompt-len` tokens, each
beginning with a token of its own (bench/common.py's `make_prompts`), `--gen-len` tokens
each (EOS ignored), at most `--concurrency` in flight, against a server with the cache
and one with --disable-prefix-cache.  Both stay up and are used in turn: `--repeats`
pairs, alternating which goes first, each pair on prompts no other run used.  Output
tok/s = output tokens ÷ wall time, per run; then the mean and standard deviation of the
paired differences (on − off).  The cache server is flushed before each of its runs, and
its hit counter must not move (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import types
from pathlib import Path

import httpx

from bench.common import http_one, http_run, make_prompts, start_server, write_json
from loadtest.reconcile import PREFIX_HITS, PREFIX_QUERIES, scrape
from loadtest.server import LocalServer, auth_headers
from loadtest.workloads import system_prompt
from serving.model_files import load_tokenizer


def client(url: str, connections: int = 4) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, timeout=1800, headers=auth_headers(), limits=httpx.Limits(max_connections=connections)
    )


async def flush(c: httpx.AsyncClient) -> None:
    r = await c.post("/flush_cache", json={})
    if r.status_code != 200:
        raise RuntimeError(f"POST /flush_cache answered {r.status_code}: {r.text[:300]}")


def prefix_counters(url: str) -> tuple[float, float]:
    """(hits, queries) of the prefix cache so far, from /metrics; (0, 0) if the server has none."""
    s = scrape(url)
    return (s.total(PREFIX_HITS), s.total(PREFIX_QUERIES)) if s else (0.0, 0.0)


async def cold_warm(
    url: str, system: list[int], users: list[list[int]], rounds: int, warm: int, gen: int
) -> tuple[list[float], list[float]]:
    """TTFT ms of the cold requests (one per round, right after a flush) and of the warm ones."""
    cold, hot, turns = [], [], iter(users)
    async with client(url) as c:
        for _ in range(rounds):
            await flush(c)
            cold.append((await http_one(c, system + next(turns), gen))[0])
            for _ in range(warm):
                hot.append((await http_one(c, system + next(turns), gen))[0])
    return cold, hot


async def throughput(url: str, prompts: list[list[int]], gen: int, concurrency: int, flush_first: bool) -> dict:
    """All prompts, at most `concurrency` in flight; output tok/s = output tokens ÷ wall time."""
    gate = asyncio.Semaphore(concurrency)
    async with client(url, concurrency + 2) as c:
        if flush_first:
            await flush(c)

        async def one(p: list[int]):
            async with gate:
                return await http_one(c, p, gen)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(r[1] for r in res)
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "ttft_p50_ms": statistics.median(r[0] for r in res),
    }


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=20)
    ap.add_argument("--ttft-gen", type=int, default=4, help="tokens per cold/warm request")
    ap.add_argument("--cold", type=int, default=5, help="rounds: a flush, one cold request, then --warm warm ones")
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--ab-requests", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="on/off pairs (at least 3)")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for both servers, e.g. --server-arg=--dtype=float32 (repeatable)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="a small run: 2 rounds × 3 warm; 3 pairs of 8 requests × 16 tokens"
    )
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    a = ap.parse_args()
    if a.quick:
        a.cold, a.warm, a.ab_requests, a.gen_len, a.repeats = 2, 3, 8, 16, 3
    if a.repeats < 3 or a.cold < 1:
        ap.error("--repeats must be at least 3 and --cold at least 1")
    return a


def main() -> None:
    a = parse_args()
    tok, _ = load_tokenizer(a.model)
    m = types.SimpleNamespace(tokenizer=tok)  # make_prompts only needs .tokenizer
    system = tok(system_prompt(a.system_tokens))["input_ids"][: a.system_tokens]
    n_users = a.cold * (a.warm + 1)
    users = make_prompts(m, n_users, a.user_tokens)
    warmup = make_prompts(m, 2, a.prompt_len, start=n_users)
    ab = [make_prompts(m, a.ab_requests, a.prompt_len, start=n_users + 2 + k * a.ab_requests) for k in range(a.repeats)]
    out: dict = {"model": a.model, "cpus": os.cpu_count(), "server_args": a.server_arg}
    with tempfile.TemporaryDirectory() as tmp:
        servers: dict[str, LocalServer] = {}
        try:
            servers["on"] = start_server(a.model, 0, Path(tmp) / "on.log", a.server_arg)
            servers["off"] = start_server(a.model, 0, Path(tmp) / "off.log", [*a.server_arg, "--disable-prefix-cache"])
            for s in servers.values():
                asyncio.run(http_run(s.url, warmup, 4))
            on = servers["on"].url

            h0, q0 = prefix_counters(on)
            cold, warm = asyncio.run(cold_warm(on, system, users, a.cold, a.warm, a.ttft_gen))
            h1, q1 = prefix_counters(on)
            out["cold_warm"] = {
                "system_tokens": len(system),
                "user_tokens": a.user_tokens,
                "gen_tokens": a.ttft_gen,
                "cold_ttft_ms": cold,
                "warm_ttft_ms": warm,
                "cold_p50_ms": p50(cold),
                "warm_p50_ms": p50(warm),
                "warm_over_cold": p50(warm) / p50(cold),
                "prefix_hits_tokens": h1 - h0,
                "prefix_queries_tokens": q1 - q0,
            }

            runs = []
            for k, prompts in enumerate(ab):
                for mode in ("on", "off") if k % 2 == 0 else ("off", "on"):
                    before = prefix_counters(servers[mode].url)[0]
                    r = asyncio.run(throughput(servers[mode].url, prompts, a.gen_len, a.concurrency, mode == "on"))
                    r.update(cache=mode, pair=k, prefix_hits_tokens=prefix_counters(servers[mode].url)[0] - before)
                    runs.append(r)
                    print(
                        f"pair {k} cache {mode:3}: {r['tok_s']:6.1f} output tok/s, {r['tokens']} tokens in "
                        f"{r['wall_s']:.1f} s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, prefix hits "
                        f"{r['prefix_hits_tokens']:.0f} tokens",
                        flush=True,
                    )
        finally:
            for s in servers.values():
                s.stop()

    tok_s = {mode: [r["tok_s"] for r in runs if r["cache"] == mode] for mode in ("on", "off")}
    diffs = [x - y for x, y in zip(tok_s["on"], tok_s["off"])]
    mean_off = statistics.mean(tok_s["off"])
    out["ab"] = {
        "requests": a.ab_requests,
        "prompt_len": a.prompt_len,
        "gen_len": a.gen_len,
        "concurrency": a.concurrency,
        "runs": runs,
        "diff_mean_tok_s": statistics.mean(diffs),
        "diff_sd_tok_s": statistics.stdev(diffs),
        "diff_mean_pct": 100 * statistics.mean(diffs) / mean_off,
    }
    cw, ab_ = out["cold_warm"], out["ab"]
    print(f"\nmodel {a.model}, {os.cpu_count()} CPUs, server flags: {' '.join(a.server_arg) or '(defaults)'}")
    print(
        f"(a) {cw['system_tokens']}-token shared prefix + {a.user_tokens}-token user turn, {a.ttft_gen} tokens: "
        f"TTFT p50 cold {cw['cold_p50_ms']:.0f} ms ({len(cold)} requests, flushed before each), warm "
        f"{cw['warm_p50_ms']:.0f} ms ({len(warm)} requests); warm/cold = {cw['warm_over_cold']:.3f} "
        f"({'meets' if cw['warm_over_cold'] <= 0.2 else 'MISSES'} the ≤ 1/5 goal)"
    )
    print(f"    prefix cache: {cw['prefix_hits_tokens']:.0f} of {cw['prefix_queries_tokens']:.0f} prompt tokens reused")
    print(
        f"(b) {a.ab_requests} distinct {a.prompt_len}-token prompts × {a.gen_len} tokens, concurrency "
        f"{a.concurrency}, {a.repeats} on/off pairs: on {', '.join(f'{x:.1f}' for x in tok_s['on'])} | off "
        f"{', '.join(f'{x:.1f}' for x in tok_s['off'])} output tok/s"
    )
    print(
        f"    on − off: {ab_['diff_mean_tok_s']:+.1f} tok/s mean (sd {ab_['diff_sd_tok_s']:.1f}, pairs "
        f"{', '.join(f'{d:+.1f}' for d in diffs)}), {ab_['diff_mean_pct']:+.1f} % of off"
    )
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
