"""Three replicas behind a real HAProxy, scraped one by one by a real Prometheus.

The proof that the dashboards and the alerts are right across instances: three `tiny-random`
servers behind deploy/haproxy/haproxy.cfg (least connections, SSE unbuffered, /health checks)
and a Prometheus scraping each replica (job="sightline", one `instance` each) with the generated
rules. Under mixed streamed and non-streamed load through HAProxy: every dashboard query and
recording rule returns data; the requests and generation tokens summed over the instances equal
the client's counts, in Prometheus and in direct scrapes (and HAProxy's per-replica counts equal
each replica's); timeouts (504) on several replicas make ONE availability burn-rate alert, with
no instance label. Then one replica is SIGKILLed with streams in flight: its streams are cut
(the client sees an incomplete chunked body, no [DONE]; streams on the others finish), HAProxy
takes it out of rotation, every later request succeeds on the survivors, and SightlineDown
names that instance.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dashboards import generate, slo
from tests.prom_util import HAProxy, Prometheus, local_prometheus_config, queries_without_data, require_tool
from tests.server_util import ServerProc, scrape, value

REPO = Path(__file__).resolve().parents[2]
REPLICAS = 3
# The shipped SightlineDown waits `for: 1m`; the test's copy of the rules fires at once.
LIVE_RULES = {"SightlineDown": {"for": "0s"}}
LOAD = 60  # requests through HAProxy, in two waves of 30 at once, half streamed
TIMEOUTS = 9  # requests with a deadline they cannot meet: 504, spread over the replicas
AFTER_KILL = 12  # requests sent once HAProxy has taken the dead replica out
JOB = 'job="sightline"'



async def _mixed_load(url: str, n: int, first: int = 0) -> list[dict]:
    """`n` requests at once (numbered from `first`), alternating streamed chat and non-streamed
    completions, every tenth an embeddings request instead; each result: status, completion tokens
    from `usage`, the replica that served it."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> dict:
            tokens = 4 + i % 13
            if i % 10 == 9:  # the replicas pool (--pooling last): the embeddings panels get data too
                r = await client.post("/v1/embeddings", json={"input": [f"Replica test {i}", "and one more"]})
                return {"status": r.status_code, "tokens": 0, "replica": r.headers["x-sightline-replica"]}
            if i % 2:
                r = await client.post("/v1/completions", json={"prompt": f"Replica test {i}:", "max_tokens": tokens})
                return {"status": r.status_code, "tokens": r.json()["usage"]["completion_tokens"],
                        "replica": r.headers["x-sightline-replica"]}
            body = {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            usage = json.loads(lines[-2][len("data: "):])["usage"]
            return {"status": r.status_code, "tokens": usage["completion_tokens"],
                    "replica": r.headers["x-sightline-replica"]}

        return await asyncio.gather(*(one(i) for i in range(first, first + n)))


async def _deadlines(url: str, n: int) -> list[int]:
    """`n` requests whose 0.2 s deadline (x-request-timeout) passes mid-generation: 504 each."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(i: int) -> int:
            r = await client.post("/v1/completions", headers={"x-request-timeout": "0.2"},
                                  json={"prompt": f"Too slow {i}", "max_tokens": 2000, "ignore_eos": True})
            return r.status_code
        return await asyncio.gather(*(one(i) for i in range(n)))


def _long_stream(url: str, i: int, started, results: dict) -> None:
    """A stream long enough to be still running when its replica is killed, which waits for every stream's first
    event (150 tokens could all be out by then): records its replica, the events read and how it ended."""
    body = {"prompt": f"Long stream {i}", "max_tokens": 600, "ignore_eos": True, "stream": True}
    out = results[i] = {"events": 0, "done": False, "error": None, "replica": None}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            out["replica"], out["status"] = r.headers.get("x-sightline-replica"), r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"] += 1
                    out["done"] = line == "data: [DONE]"
                    started.set()
    except httpx.HTTPError as exc:
        out["error"] = exc
    started.set()


def _alerts(prom: Prometheus, name: str | None = None) -> list[dict]:
    return [a for a in prom.api("alerts")["alerts"]
            if a["state"] == "firing" and (name is None or a["labels"]["alertname"] == name)]


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
        starting = [pool.submit(ServerProc, "--pooling", "last", tmpdir=d) for d in dirs]
        failed = [f.exception(180) for f in starting]
        servers = [f.result() for f, e in zip(starting, failed) if e is None]
        if any(failed):
            raise next(e for e in failed if e)
        addrs = [f"127.0.0.1:{s.port}" for s in servers]
        names = [f"replica{i + 1}" for i in range(REPLICAS)]
        by_name = dict(zip(names, servers))
        lb = HAProxy(tmp_path, addrs)
        prom = Prometheus(tmp_path, local_prometheus_config(tmp_path / "prom.yml", tmp_path / generate.RULES_DIR,
                                                            addrs))
        prom.wait_ready()
        lb.wait_all("UP", names)
        prom.wait_for("every replica scraped",
                      lambda: len(prom.api("query", query=f"up{{{JOB}}} == 1")["result"]) == REPLICAS, 30)
        started = time.monotonic()
        start = time.time()

        # -- load through HAProxy; the totals reconcile ---------------------------------------
        # in two waves a few scrapes apart: a series first scraped after all of its load shows no rate (histograms
        # appear on their first observation), so a load that fits between two scrapes would leave panels empty
        results = asyncio.run(_mixed_load(lb.url, LOAD // 2))
        time.sleep(2.5)
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
        prom.wait_for("Prometheus' totals equal the client's", lambda: (
            prom_total(f"sum(sightline_requests_total{{{JOB}}})") == sent
            and prom_total(f"sum(sightline_generation_tokens_total{{{JOB}}})") == tokens), 20)
        per_instance = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.api(
            "query", query=f"sum by (instance) (sightline_requests_total{{{JOB}}})")["result"]}
        assert per_instance == dict(zip(addrs, direct_requests))
        print(f"\nreconciled: client {sent} requests / {tokens} tokens; direct scrapes {direct_requests} / "
              f"{direct_tokens}; HAProxy per replica {[int(stats[n]['stot']) for n in names]}; Prometheus "
              f"{prom_total(f'sum(sightline_requests_total{{{JOB}}})'):g} / "
              f"{prom_total(f'sum(sightline_generation_tokens_total{{{JOB}}})'):g}")

        # -- 504s on several replicas: one service-level burn-rate alert ----------------------
        assert asyncio.run(_deadlines(lb.url, TIMEOUTS)) == [504] * TIMEOUTS
        timeouts = [value(scrape(s), "sightline_requests_total", status="504") for s in servers]
        assert sum(timeouts) == TIMEOUTS and sum(t > 0 for t in timeouts) >= 2, timeouts
        burn = prom.wait_for("SightlineAvailabilityBudgetBurn firing",
                             lambda: len(_alerts(prom, "SightlineAvailabilityBudgetBurn")) == 2
                             and _alerts(prom, "SightlineAvailabilityBudgetBurn"), 30)
        assert sorted(a["labels"]["severity"] for a in burn) == ["page", "ticket"], burn
        assert all("instance" not in a["labels"] for a in burn), burn
        prom.wait_for("Prometheus counts every 504", lambda: prom_total(
            f'sum(sightline_requests_total{{{JOB}, status="504"}})') == TIMEOUTS, 20)  # the alert may fire on fewer
        time.sleep(2)  # an evaluation with the alerts firing inside [start, end]: the query range's last point
        end = time.time()
        time.sleep(2)  # a scrape and an evaluation past `end`
        missing, evaluated = queries_without_data(prom, start, end)
        assert missing == [], "no data for:\n" + "\n".join(missing)

        # -- kill a replica with streams in flight --------------------------------------------
        streams: dict[int, dict] = {}
        events = [threading.Event() for _ in range(2 * REPLICAS)]
        readers = [pool.submit(_long_stream, lb.url, i, events[i], streams) for i in range(2 * REPLICAS)]
        assert all(e.wait(30) for e in events), streams
        victim_name = next(n for n in names if any(s["replica"] == n for s in streams.values()))
        victim = by_name[victim_name]
        victim_addr = addrs[names.index(victim_name)]
        os.kill(victim.proc.pid, signal.SIGKILL)  # its children die with it (PR_SET_PDEATHSIG)
        for f in readers:
            f.result(120)
        cut = [s for s in streams.values() if s["replica"] == victim_name]
        whole = [s for s in streams.values() if s["replica"] != victim_name]
        # HAProxy had sent 200 and part of the body: it closes the client connection mid-body
        for s in cut:
            assert s["status"] == 200 and not s["done"] and s["events"] >= 1, s
            assert isinstance(s["error"], httpx.RemoteProtocolError), s
            assert "incomplete chunked read" in str(s["error"]), s
        assert cut and whole and all(s["done"] and s["error"] is None for s in whole), streams
        print(f"killed {victim_name} ({victim_addr}): its streams {[(s['events'], repr(s['error'])) for s in cut]}; "
              f"{len(whole)} streams on the others ended with [DONE]")

        survivors = {n: s for n, s in by_name.items() if n != victim_name}
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
        print(f"service-level alerts firing: {sorted(keys)}; {evaluated} queries and rules had data; "
              f"{time.monotonic() - started:.1f} s from the first request, {time.monotonic() - t0:.1f} s in all")
    finally:
        if prom is not None:
            prom.stop()
        if lb is not None:
            lb.stop()
        list(pool.map(lambda s: s.stop(), servers))
        pool.shutdown(wait=False, cancel_futures=True)
