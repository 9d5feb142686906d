"""Chaos soak: 2 tokenizer workers x 2 engine ranks under mixed load while processes die.

    .venv/bin/python -m loadtest.chaos --seconds 600 [--model tiny-random] [--users 8]

Closed-loop users send completions and chat requests (70 % streamed, 4-64 tokens), each
with a deadline (`x-request-timeout`); meanwhile a tokenizer worker, a Scheduler rank and
the Detokenizer are SIGKILLed in turn (shuffled each round), at random intervals once the
server is healthy again.  Every request must end within its deadline plus a margin, as a
result (200, complete) or an explicit error (a 4xx/5xx JSON error, an SSE error event
then [DONE], or the connection of a killed worker closing); none may hang, and the
outcomes must sum to the requests sent.  Once the load stops, nothing may stay in flight
or hold KV, and no process's RSS may grow more than `--max-growth` from its baseline (its
RSS once it has been up `--warmup` seconds of healthy samples; a process replaced sooner
is not compared).  Prints one line per fault and a summary; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.server import LocalServer
from loadtest.soak import WORDS, read_metrics

FLAGS = ["--tokenizer-worker-num", "2", "--dp-size", "2", "--max-engine-restarts", "1000", "--log-level", "warning"]
VICTIMS = ("worker", "rank", "detokenizer")
MARGIN = 15.0  # seconds past its deadline a request may take to end (a restart's 503s are immediate)


@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # ok | error_<status> | error_event | connection_lost | hung
    faults: Counter = field(default_factory=Counter)
    rss: list[tuple[float, dict]] = field(default_factory=list)  # (t, {(role, pid): bytes}) samples


async def one(c: httpx.AsyncClient, rng: random.Random, deadline: float) -> str:
    """One request's outcome."""
    stream, chat = rng.random() < 0.7, rng.random() < 0.5
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
    body = {"max_tokens": rng.randint(4, 64), "stream": stream}
    body.update({"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"x-request-timeout": f"{deadline:g}"}
    try:
        async with asyncio.timeout(deadline + MARGIN):
            async with c.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    json.loads(r.text)["error"]  # an explicit, OpenAI-style error
                    return f"error_{r.status_code}"
                if not stream:
                    await r.aread()
                    return "ok" if json.loads(r.text).get("choices") else "malformed"
                last, done = None, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        last = line
            return "malformed" if not done else "error_event" if last and '"error"' in last else "ok"
    except TimeoutError:
        return "hung"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError, httpx.WriteError):
        return "connection_lost"  # a killed worker's connections close with it


async def user(url: str, rng: random.Random, stop: asyncio.Event, tally: Tally, deadline: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=None) as c:
        while not stop.is_set():
            tally.sent += 1
            outcome = await one(c, rng, deadline)
            tally.outcomes[outcome] += 1
            if outcome != "ok":  # as a client honouring Retry-After would: no retry storm while the engine restarts
                await asyncio.sleep(rng.uniform(0.2, 0.6))


async def healthy(c: httpx.AsyncClient, timeout: float, stop: asyncio.Event | None = None) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not (stop and stop.is_set()):
        try:
            if (await c.get("/health")).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    return False


def victim_pid(pids: dict[str, int], kind: str, rng: random.Random) -> tuple[str, int] | None:
    prefix = {"worker": "worker-", "rank": "scheduler_dp", "detokenizer": "detokenizer"}[kind]
    roles = sorted(r for r in pids if r.startswith(prefix))
    if not roles:
        return None
    role = rng.choice(roles)
    return role, pids[role]


async def faults(
    url: str, rng: random.Random, stop: asyncio.Event, tally: Tally, a: argparse.Namespace, t0: float
) -> None:
    """Kill one process of each kind per round (shuffled), `--min-gap`..`--max-gap` seconds apart: after
    the server is healthy again, or with `--overlap` whatever it is doing (a restart included)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        await healthy(c, 120, stop)
        while not stop.is_set():
            for kind in rng.sample(VICTIMS, len(VICTIMS)):
                if a.max_faults and sum(tally.faults.values()) >= a.max_faults:
                    return
                if not a.overlap and not await healthy(c, 120, stop) and not stop.is_set():
                    raise RuntimeError("the server did not become healthy again within 120 s")
                try:
                    await asyncio.wait_for(stop.wait(), rng.uniform(a.min_gap, a.max_gap))
                    return
                except TimeoutError:
                    pass
                found = victim_pid((await c.get("/debug/state")).json()["pids"], kind, rng)
                if found is None:
                    continue
                role, pid = found
                os.kill(pid, signal.SIGKILL)
                tally.faults[kind] += 1
                print(
                    f"[{time.monotonic() - t0:6.1f} s] SIGKILL {role} (pid {pid}); requests so far {tally.sent}",
                    flush=True,
                )
                await asyncio.sleep(1.0)  # the supervisor notices it before health is asked again


async def sample_once(c: httpx.AsyncClient, tally: Tally, t0: float) -> None:
    """Each process's RSS by (role, pid), only while healthy: every process ready, none still loading."""
    if (await c.get("/health")).status_code == 200:
        pids = {**(await c.get("/debug/state")).json()["pids"], "main": 0}  # the hub: never replaced
        rss = read_metrics((await c.get("/metrics")).text)["rss"]
        tally.rss.append((time.monotonic() - t0, {(r, pids[r]): b for r, b in rss.items() if r in pids}))


async def sample_rss(url: str, stop: asyncio.Event, tally: Tally, interval: float, t0: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        while not stop.is_set():
            try:
                await sample_once(c, tally, t0)
            except httpx.TransportError:  # its connection was on a tokenizer worker just killed: no sample
                pass
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass


async def settle(url: str, timeout: float) -> dict:
    """/debug/state once nothing is in flight and no request holds KV anywhere (or as it is after `timeout`)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        await healthy(c, timeout)
        end = time.monotonic() + timeout
        while True:
            st = (await c.get("/debug/state")).json()
            idle = (
                st["in_flight"] == 0
                and st["detokenizer"]["active_rids"] == 0
                and all(
                    s["num_running"] == 0
                    and s["num_waiting"] == 0
                    and s["kv_reserved"] == 0
                    and s["kv_used"] == s["prefix_cached_tokens"]
                    for s in st["schedulers"]
                )
            )
            if idle or time.monotonic() > end:
                return {"idle": idle, "state": st}
            await asyncio.sleep(0.5)


async def chaos(url: str, a: argparse.Namespace) -> tuple[Tally, dict]:
    tally, stop, t0 = Tally(), asyncio.Event(), time.monotonic()
    rng = random.Random(a.seed)
    users = [
        asyncio.create_task(user(url, random.Random(a.seed * 1000 + i), stop, tally, a.deadline))
        for i in range(a.users)
    ]
    side = [
        asyncio.create_task(faults(url, rng, stop, tally, a, t0)),
        asyncio.create_task(sample_rss(url, stop, tally, a.interval, t0)),
    ]
    await asyncio.sleep(a.seconds)
    stop.set()
    await asyncio.gather(*users)
    for task in side:
        await task  # a fault loop that failed (the server never came back) raises here
    settled = await settle(url, 60)
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        await sample_once(c, tally, t0)  # the end point of every RSS comparison
    return tally, settled


def report(tally: Tally, settled: dict, a: argparse.Namespace) -> bool:
    seen: dict[tuple[str, int], float] = {}  # each process's first healthy sample time
    first: dict[tuple[str, int], float] = {}  # its RSS once it has served `--warmup` seconds
    for t, s in tally.rss:
        for proc, rss in s.items():
            seen.setdefault(proc, t)
            if t - seen[proc] >= a.warmup:
                first.setdefault(proc, rss)
    last = tally.rss[-1][1] if tally.rss else {}
    worst = 0.0
    for role, pid in sorted(first.keys() & last.keys()):  # from its warm-up to the end, if it lived that long
        growth = last[role, pid] / first[role, pid] - 1
        worst = max(worst, growth)
        print(
            f"RSS {role} (pid {pid or 'hub'}): {first[role, pid] / 2**20:.0f} -> {last[role, pid] / 2**20:.0f} MiB "
            f"({100 * growth:+.1f} %)"
        )
    ended = sum(tally.outcomes.values())
    lost, hung = tally.sent - ended, tally.outcomes["hung"] + tally.outcomes["malformed"]
    print(f"requests {tally.sent}: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    print(
        f"faults injected: {sum(tally.faults.values())} (" + ", ".join(f"{k} {tally.faults[k]}" for k in VICTIMS) + ")"
    )
    ok = (
        hung == 0
        and lost == 0
        and settled["idle"]
        and worst <= a.max_growth
        and all(tally.faults[k] >= a.min_faults for k in VICTIMS)
    )
    print(
        f"chaos {'passed' if ok else 'FAILED'}: hung {hung}, lost {lost}, idle after the load "
        f"{settled['idle']}, worst RSS growth after warm-up {100 * worst:+.1f} % (limit {100 * a.max_growth:.0f} %)"
    )
    if not settled["idle"]:
        print(json.dumps(settled["state"])[:3000])
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=30.0, help="each request's x-request-timeout, seconds")
    ap.add_argument("--min-gap", type=float, default=3.0, help="seconds between recovery and the next fault")
    ap.add_argument("--max-gap", type=float, default=15.0)
    ap.add_argument("--min-faults", type=int, default=1, help="of each kind, for a pass")
    ap.add_argument("--max-faults", type=int, default=0, help="stop injecting after this many (0: never)")
    ap.add_argument("--overlap", action="store_true", help="inject the next fault without waiting for recovery")
    ap.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds a process serves (healthy samples) before its RSS baseline is taken",
    )
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--max-growth", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=33)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalServer(a.model, a.port, Path(tmp) / "server.log", FLAGS)
        try:
            tally, settled = asyncio.run(chaos(server.url, a))
        finally:
            code = server.stop(timeout=60)
    ok = report(tally, settled, a)
    print(f"server exit code {code}")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
