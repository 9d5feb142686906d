"""Three replicas behind a real HAProxy, scraped one by one by a real Prometheus.

The proof that the dashboards and the alerts are right across instances: three `tiny-random`
servers behind deploy/haproxy/haproxy.cfg (least connections, SSE unbuffered, /health checks)
and a Prometheus scraping each replica (job="sightline", one `instance` each) with the generated
rules. Under mixed streamed and non-streamed load through HAProxy: every dashboard query and
recording rule returns data; the requests and generation tokens summed over the instances equal
the client's counts, in Prometheus and in direct scrapes (and HAProxy's per-replica counts equal
each replica's); timeouts (504) on every replica make ONE availability burn-rate alert, with
no instance label. Then one replica is SIGKILLed with held streams in flight (two on each
replica): its two streams are cut (the client sees an incomplete chunked body, no [DONE]; the
streams on the others finish once released), HAProxy takes it out of rotation, every later
request succeeds on the survivors, and SightlineDown names that instance.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dashboards import generate, slo
from tests.prom_util import HAProxy, Prometheus, local_prometheus_config, queries_without_data, require_tool
from tests.server_util import HOLD, ServerProc, scrape, value, wait_until

REPO = Path(__file__).resolve().parents[2]
REPLICAS = 3
# The shipped SightlineDown waits `for: 1m`; the test's copy of the rules fires at once.
LIVE_RULES = {"SightlineDown": {"for": "0s"}}
LOAD = 60  # requests through HAProxy, in two waves of 30 at once, half streamed
TIMEOUTS = 9  # held requests with a deadline: 504, three on each replica
STREAMS = 2 * REPLICAS  # held streams when a replica is killed: two on each
STREAM_TOKENS = 8  # each held at 7 until its replica dies or it is released
AFTER_KILL = 12  # requests sent once HAProxy has taken the dead replica out
JOB = 'job="sightline"'


async def _mixed_load(url: str, n: int, first: int = 0) -> list[dict]:
    """`n` requests at once (numbered from `first`), alternating streamed chat and non-streamed
    completions (some with a structured output), every tenth an embeddings request instead; each result:
    status, completion tokens from `usage`, the replica that served it."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(i: int) -> dict:
            tokens = 4 + i % 13
            if i % 10 == 9:  # the replicas pool (--pooling last): the embeddings panels get data too
                r = await client.post("/v1/embeddings", json={"input": [f"Replica test {i}", "and one more"]})
                return {"status": r.status_code, "tokens": 0, "replica": r.headers["x-sightline-replica"]}
            if i % 2:
                body = {"prompt": f"Replica test {i}:", "max_tokens": tokens}
                if i % 10 == 3:  # a structured output: the grammar panels get data too (compiles in both waves)
                    body["structured_outputs"] = {
                        "json": {
                            "type": "object",
                            "properties": {f"k{i}": {"enum": ["a", "b"]}},
                            "required": [f"k{i}"],
                        },
                        "disable_any_whitespace": True,
                    }
                # objectives (every third one missed): the server-side goodput panels get data
                slo = {"x-llm-d-slo-ttft-ms": "60000", **({"x-sightline-slo-e2e-ms": "0.001"} if i % 3 == 1 else {})}
                r = await client.post("/v1/completions", json=body, headers=slo)
                return {
                    "status": r.status_code,
                    "tokens": r.json()["usage"]["completion_tokens"],
                    "replica": r.headers["x-sightline-replica"],
                }
            body = {
                "messages": [{"role": "user", "content": f"Say {i}"}],
                "max_tokens": tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            usage = json.loads(lines[-2][len("data: ") :])["usage"]
            return {
                "status": r.status_code,
                "tokens": usage["completion_tokens"],
                "replica": r.headers["x-sightline-replica"],
            }

        return await asyncio.gather(*(one(i) for i in range(first, first + n)))


async def _deadlines(url: str, n: int) -> list[int]:
    """`n` held requests at once (so least connections spreads them evenly), each running until its
    1 s deadline (x-request-timeout) passes: 504 each."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(i: int) -> int:
            r = await client.post(
                "/v1/completions",
                headers={"x-request-timeout": "1"},
                json={"prompt": f"Too slow {i}", "max_tokens": 8, **HOLD},
            )
            return r.status_code

        return await asyncio.gather(*(one(i) for i in range(n)))


def _held_stream(url: str, i: int, results: dict) -> None:
    """A held /generate stream (STREAM_TOKENS - 1 tokens, then it waits for a release or a cut): records
    its replica, the tokens read (each event carries them all so far) and how it ended."""
    body = {"text": f"Long stream {i}", "stream": True, "sampling_params": {"max_new_tokens": STREAM_TOKENS, **HOLD}}
    out = results[i] = {"tokens": 0, "done": False, "error": None, "replica": None}
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
            out["replica"], out["status"] = r.headers.get("x-sightline-replica"), r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    out["tokens"] = len(json.loads(line[len("data: ") :])["output_ids"])
    except httpx.HTTPError as exc:
        out["error"] = exc


def _alerts(prom: Prometheus, name: str | None = None) -> list[dict]:
    return [
        a
        for a in prom.api("alerts")["alerts"]
        if a["state"] == "firing" and (name is None or a["labels"]["alertname"] == name)
    ]


def test_replicas_behind_haproxy_reconcile_and_alert_per_scope(tmp_path):
    require_tool("haproxy"), require_tool("prometheus")
    t0 = time.monotonic()
    generate.write(tmp_path, generate.rule_outputs(slo.load(overrides=LIVE_RULES)))
    dirs = [tmp_path / f"replica{i + 1}" for i in range(REPLICAS)]
    for d in dirs:
        d.mkdir()
    servers: list[ServerProc] = []
    lb = prom = None
    pool = ThreadPoolExecutor(REPLICAS * 4)
    try:
        # in parallel: the model loads dominate
        starting = [pool.submit(ServerProc, "--peak-probe", "--pooling", "last", tmpdir=d) for d in dirs]
        failed = [f.exception(180) for f in starting]
        servers = [f.result() for f, e in zip(starting, failed) if e is None]
        if any(failed):
            raise next(e for e in failed if e)
        addrs = [f"127.0.0.1:{s.port}" for s in servers]
        names = [f"replica{i + 1}" for i in range(REPLICAS)]
        by_name = dict(zip(names, servers))
        lb = HAProxy(tmp_path, addrs)
        prom = Prometheus(
            tmp_path, local_prometheus_config(tmp_path / "prom.yml", tmp_path / generate.RULES_DIR, addrs)
        )
        prom.wait_ready()
        lb.wait_all("UP", names)
        prom.wait_for(
            "every replica scraped", lambda: len(prom.api("query", query=f"up{{{JOB}}} == 1")["result"]) == REPLICAS, 30
        )
        started = time.monotonic()
        start = time.time()

        # -- load through HAProxy; the totals reconcile ---------------------------------------
        # in two waves a few scrapes apart: a series first scraped after all of its load shows no rate (histograms
        # appear on their first observation), so a load that fits between two scrapes would leave panels empty
        results = asyncio.run(_mixed_load(lb.url, LOAD // 2))
        for s in servers:
            s.barrier()  # the engines' stats of the first wave are in too
        prom.scraped_after(time.time(), targets=REPLICAS)
        results += asyncio.run(_mixed_load(lb.url, LOAD - LOAD // 2, first=LOAD // 2))
        assert [r["status"] for r in results] == [200] * LOAD
        sent, tokens = len(results), sum(r["tokens"] for r in results)
        served = {n: sum(r["replica"] == n for r in results) for n in names}
        assert all(served.values()), f"least connections left a replica idle: {served}"
        direct = [scrape(s) for s in servers]
        direct_requests = [value(t, "sightline_requests_total") for t in direct]
        direct_tokens = [value(t, "sightline_generation_tokens_total") for t in direct]
        assert sum(direct_requests) == sent and sum(direct_tokens) == tokens, (direct_requests, direct_tokens)
        stats = lb.servers()
        # what HAProxy sent each replica = what the client saw it answer = what the replica counted
        assert [int(stats[n]["stot"]) for n in names] == [served[n] for n in names] == direct_requests

        def prom_total(expr: str) -> float:
            result = prom.api("query", query=expr)["result"]
            return float(result[0]["value"][1]) if result else -1

        # Prometheus' view: the same sums once it has scraped every replica after the load
        prom.wait_for(
            "Prometheus' totals equal the client's",
            lambda: (
                prom_total(f"sum(sightline_requests_total{{{JOB}}})") == sent
                and prom_total(f"sum(sightline_generation_tokens_total{{{JOB}}})") == tokens
            ),
            20,
        )
        per_instance = {
            r["metric"]["instance"]: float(r["value"][1])
            for r in prom.api("query", query=f"sum by (instance) (sightline_requests_total{{{JOB}}})")["result"]
        }
        assert per_instance == dict(zip(addrs, direct_requests))
        print(
            f"\nreconciled: client {sent} requests / {tokens} tokens; direct scrapes {direct_requests} / "
            f"{direct_tokens}; HAProxy per replica {[int(stats[n]['stot']) for n in names]}; Prometheus "
            f"{prom_total(f'sum(sightline_requests_total{{{JOB}}})'):g} / "
            f"{prom_total(f'sum(sightline_generation_tokens_total{{{JOB}}})'):g}"
        )

        # -- 504s on every replica: one service-level burn-rate alert ------------------------
        assert asyncio.run(_deadlines(lb.url, TIMEOUTS)) == [504] * TIMEOUTS
        timeouts = [value(scrape(s), "sightline_requests_total", status="504") for s in servers]
        assert timeouts == [TIMEOUTS // REPLICAS] * REPLICAS, timeouts
        burn = prom.wait_for(
            "SightlineAvailabilityBudgetBurn firing",
            lambda: (
                len(_alerts(prom, "SightlineAvailabilityBudgetBurn")) == 2
                and _alerts(prom, "SightlineAvailabilityBudgetBurn")
            ),
            30,
        )
        assert sorted(a["labels"]["severity"] for a in burn) == ["page", "ticket"], burn
        assert all("instance" not in a["labels"] for a in burn), burn
        prom.wait_for(
            "Prometheus counts every 504",
            lambda: prom_total(f'sum(sightline_requests_total{{{JOB}, status="504"}})') == TIMEOUTS,
            20,
        )  # the alert may fire on fewer
        # the query range's last point (2 s steps from `start`) is `end` itself, after the evaluation that
        # had the alerts firing; then Prometheus holds everything up to `end`
        end = math.ceil(time.time())
        start = end - 2 * math.ceil((end - start) / 2)
        prom.scraped_after(end, evaluated=True, targets=REPLICAS)
        missing, evaluated = queries_without_data(prom, start, end)
        assert missing == [], "no data for:\n" + "\n".join(missing)

        # -- kill a replica with held streams in flight ---------------------------------------
        streams: dict[int, dict] = {}
        readers = [pool.submit(_held_stream, lb.url, i, streams) for i in range(STREAMS)]
        wait_until(
            lambda: len(streams) == STREAMS and all(s["tokens"] == STREAM_TOKENS - 1 for s in streams.values()),
            60,
            "every stream held, its tokens read",
        )
        # held, so least connections put two on each replica, and they are running when the kill comes
        assert [s.held() for s in servers] == [STREAMS // REPLICAS] * REPLICAS
        assert sorted(s["replica"] for s in streams.values()) == sorted(names * (STREAMS // REPLICAS)), streams
        victim_name = names[0]
        victim = by_name[victim_name]
        victim_addr = addrs[names.index(victim_name)]
        survivors = {n: s for n, s in by_name.items() if n != victim_name}
        os.kill(victim.proc.pid, signal.SIGKILL)  # its children die with it (PR_SET_PDEATHSIG)
        for s in survivors.values():
            s.release()
        for f in readers:
            f.result(120)
        cut = [s for s in streams.values() if s["replica"] == victim_name]
        whole = [s for s in streams.values() if s["replica"] != victim_name]
        # HAProxy had sent 200 and part of the body: it closes the client connection mid-body
        for s in cut:
            assert s["status"] == 200 and not s["done"] and s["tokens"] == STREAM_TOKENS - 1, s
            assert isinstance(s["error"], httpx.RemoteProtocolError), s
            assert "incomplete chunked read" in str(s["error"]), s
        assert len(cut) == STREAMS // REPLICAS and len(whole) == STREAMS - len(cut), streams
        assert all(s["done"] and s["error"] is None and s["tokens"] == STREAM_TOKENS for s in whole), streams
        print(
            f"killed {victim_name} ({victim_addr}): its streams {[(s['tokens'], repr(s['error'])) for s in cut]}; "
            f"{len(whole)} streams on the others ended with [DONE]"
        )

        lb.wait_all("DOWN", [victim_name], 10)
        before = {n: value(scrape(s), "sightline_requests_total") for n, s in survivors.items()}
        victim_stot = int(lb.servers()[victim_name]["stot"])
        after_kill = asyncio.run(_mixed_load(lb.url, AFTER_KILL))
        assert [r["status"] for r in after_kill] == [200] * AFTER_KILL
        assert victim_name not in {r["replica"] for r in after_kill}
        after = {n: value(scrape(s), "sightline_requests_total") for n, s in survivors.items()}
        assert sum(after.values()) - sum(before.values()) == AFTER_KILL, (before, after)
        assert int(lb.servers()[victim_name]["stot"]) == victim_stot

        down = prom.wait_for("SightlineDown firing", lambda: _alerts(prom, "SightlineDown"), 20)
        assert [a["labels"]["instance"] for a in down] == [victim_addr], down
        print(f"SightlineDown: {down}")
        slo_alerts = [a for a in _alerts(prom) if "slo" in a["labels"]]
        keys = [(a["labels"]["alertname"], a["labels"]["severity"]) for a in slo_alerts]
        assert len(keys) == len(set(keys)) and all("instance" not in a["labels"] for a in slo_alerts), slo_alerts
        print(
            f"service-level alerts firing: {sorted(keys)}; {evaluated} queries and rules had data; "
            f"{time.monotonic() - started:.1f} s from the first request, {time.monotonic() - t0:.1f} s in all"
        )
    finally:
        if prom is not None:
            prom.stop()
        if lb is not None:
            lb.stop()
        list(pool.map(lambda s: s.stop(), servers))
        pool.shutdown(wait=False, cancel_futures=True)
