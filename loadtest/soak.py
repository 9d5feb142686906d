"""Soak: hours of moderate load in minutes of reading — RSS, KV usage and counters over time.

    .venv/bin/python -m loadtest.soak --minutes 30 [--model smollm2-135m] [--url URL]

Closed-loop load (`--users` clients, random prompt and output lengths, 10 % of clients
disconnecting mid-stream) while every `--interval` seconds a line shows each process's
RSS, KV slots held by requests (used minus the prefix cache's, which stay when idle),
the prefix cache's slots, in-flight requests and the request/stale-drop counters from
`/metrics`.  At the end: RSS growth of every process from the first sample after
warm-up to the last; exit 1 if any grew more than `--max-growth` (10 %), a request
failed with a 5xx, or the server did not return to idle within 15 s of the load
stopping (idle: nothing in flight, used = the prefix cache's slots, reserved = 0; else
KV slots leak).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.server import LocalServer

WORDS = "the quick brown fox jumps over a lazy dog while sightline watches every token".split()


def read_metrics(text: str) -> dict:
    out: dict = {
        "rss": {},
        "requests": 0.0,
        "drops": 0.0,
        "kv_used": 0.0,
        "kv_cached": 0.0,
        "kv_reserved": 0.0,
        "in_flight": 0.0,
        "errors": 0.0,
    }
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sightline_process_resident_memory_bytes":
                out["rss"][s.labels["role"]] = s.value
            elif s.name == "sightline_requests_total":
                out["requests"] += s.value
                out["errors"] += s.value if s.labels["status"].startswith("5") else 0
            elif s.name == "sightline_stale_messages_dropped_total":
                out["drops"] += s.value
            elif s.name == "sightline_kv_slots_used":
                out["kv_used"] = s.value
            elif s.name == "sightline_prefix_cache_tokens":
                out["kv_cached"] = s.value
            elif s.name == "sightline_kv_slots_reserved":
                out["kv_reserved"] = s.value
            elif s.name == "sightline_requests_in_flight":
                out["in_flight"] = s.value
    out["kv_requests"] = out["kv_used"] - out["kv_cached"]  # the leak signal: 0 whenever nothing runs
    return out


async def user(client: httpx.AsyncClient, rng: random.Random, stop: asyncio.Event) -> None:
    while not stop.is_set():
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200)))
        body = {"prompt": prompt, "max_tokens": rng.randint(8, 128), "temperature": 0.7, "stream": True}
        try:
            async with asyncio.timeout(rng.uniform(0.2, 2.0) if rng.random() < 0.1 else 600):
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        except (TimeoutError, httpx.HTTPError):
            pass


async def soak(url: str, minutes: float, users: int, interval: float, warmup: float) -> tuple[list[dict], dict]:
    stop = asyncio.Event()
    samples: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=users + 4)) as c:
        tasks = [asyncio.create_task(user(c, random.Random(i), stop)) for i in range(users)]
        t0 = time.monotonic()
        while time.monotonic() - t0 < minutes * 60:
            await asyncio.sleep(interval)
            m = read_metrics((await c.get("/metrics")).text)
            m["t"] = time.monotonic() - t0
            samples.append(m)
            rss = " ".join(f"{k}={v / 2**20:.0f}MiB" for k, v in sorted(m["rss"].items()))
            print(
                f"[{m['t'] / 60:5.1f} min] RSS {rss} | KV held by requests {m['kv_requests']:.0f}, prefix cache "
                f"{m['kv_cached']:.0f} | in flight {m['in_flight']:.0f}"
                f" | requests {m['requests']:.0f} (5xx {m['errors']:.0f}) | stale drops {m['drops']:.0f}",
                flush=True,
            )
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        idle = await settled(c)
    print(
        f"idle: KV held by requests {idle['kv_requests']:.0f}, reserved {idle['kv_reserved']:.0f}, prefix cache "
        f"{idle['kv_cached']:.0f}, in flight {idle['in_flight']:.0f}"
    )
    return [s for s in samples if s["t"] >= warmup * 60] or samples[-1:], idle


async def settled(c: httpx.AsyncClient, timeout: float = 15.0) -> dict:
    """/metrics once nothing is in flight and requests hold no KV (or as it is after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics((await c.get("/metrics")).text)
        if time.monotonic() > deadline or (m["in_flight"] == 0 and m["kv_requests"] == 0 and m["kv_reserved"] == 0):
            return m
        await asyncio.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--url", default=None)
    ap.add_argument("--port", type=int, default=8393)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=2.0, help="minutes before the RSS baseline is taken")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--interval", type=float, default=60.0)
    ap.add_argument("--max-growth", type=float, default=0.10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = None if a.url else LocalServer(a.model, a.port, Path(tmp) / "server.log", ["--log-level", "warning"])
        try:
            kept, idle = asyncio.run(soak(a.url or server.url, a.minutes, a.users, a.interval, a.warmup))
        finally:
            if server is not None:
                server.stop(timeout=60)
    first, last = kept[0], kept[-1]
    worst = 0.0
    for role, rss in sorted(last["rss"].items()):
        growth = rss / first["rss"].get(role, rss) - 1
        worst = max(worst, growth)
        print(f"RSS {role}: {first['rss'].get(role, rss) / 2**20:.0f} → {rss / 2**20:.0f} MiB ({100 * growth:+.1f} %)")
    leaked = idle["in_flight"] != 0 or idle["kv_requests"] != 0 or idle["kv_reserved"] != 0
    ok = worst <= a.max_growth and last["errors"] == 0 and not leaked
    print(
        f"soak {'passed' if ok else 'FAILED'}: worst RSS growth after warm-up {100 * worst:+.1f} % "
        f"(limit {100 * a.max_growth:.0f} %), 5xx {last['errors']:.0f}, KV slots held when idle "
        f"{idle['kv_requests']:.0f} (reserved {idle['kv_reserved']:.0f})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
