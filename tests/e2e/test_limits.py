"""Timeouts, overload shedding and body limits, against a real server (tiny-random)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server_util import ServerProc, scrape, sse_events, value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc("--max-running-requests", "2", "--max-queued-requests", "6", "--max-queue-time", "1.5",
                     "--max-request-bytes", "20000", tmpdir=tmp_path_factory.mktemp("limits"))
    yield srv
    srv.stop()


def wait_idle(srv: ServerProc, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = srv.debug()
        sched = st["scheduler"]
        if (st["in_flight"] == 0 and sched["num_running"] == 0 and sched["num_waiting"] == 0
                and sched["kv_used"] == sched["prefix_cached_tokens"]):
            return st
        time.sleep(0.1)
    raise AssertionError(f"server did not go idle: {srv.debug()}")


LONG = {"prompt": "go on", "max_tokens": 1800, "ignore_eos": True}


def test_request_timeout_header_aborts_down_to_the_scheduler(server):
    t0 = time.monotonic()
    r = server.post("/v1/completions", LONG, headers={"x-request-timeout": "0.5"})
    took = time.monotonic() - t0
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
    assert 0.4 < took < 3.0
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                      headers={"x-request-timeout": "0.5"}, timeout=30) as s:
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "timeout"
    wait_idle(server)
    text = scrape(server)
    assert value(text, "sightline_request_aborts_total", reason="timeout") == 2
    assert value(text, "sightline_requests_total", finish_reason="abort", status="504") == 2
    bad = server.post("/v1/completions", {"prompt": "x"}, headers={"x-request-timeout": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout"


def test_queue_wait_limit(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            # two long requests fill --max-running-requests 2; the third waits and expires
            blockers = [asyncio.create_task(c.post("/v1/completions", json={**LONG, "max_tokens": 600}))
                        for _ in range(2)]
            await asyncio.sleep(0.5)
            waiting = await c.post("/v1/completions", json={"prompt": "queued", "max_tokens": 4})
            for b in blockers:
                b.cancel()
            await asyncio.gather(*blockers, return_exceptions=True)
            return waiting

    r = asyncio.run(main())
    assert r.status_code == 504 and "queue" in r.json()["error"]["message"], r.text
    wait_idle(server)


def test_overload_sheds_with_429_and_accounting_reconciles(server):
    before = scrape(server)
    sent = 40

    async def one(c: httpx.AsyncClient, i: int) -> str:
        r = await c.post("/v1/completions", json={"prompt": f"load {i}", "max_tokens": 24, "ignore_eos": True})
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "overloaded_error"
            return "rejected"
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 24
            return "completed"
        if r.status_code == 504:  # waited longer than --max-queue-time: an explicit timeout
            return "timed_out"
        return f"other {r.status_code}"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(sent)))

    outcomes = asyncio.run(main())
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    assert counts.get("rejected", 0) >= 10 and counts.get("completed", 0) >= 2, counts
    assert sum(counts.values()) == sent and set(counts) <= {"completed", "rejected", "timed_out"}, counts
    wait_idle(server)
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("sightline_requests_total", status="200") == counts["completed"]
    assert delta("sightline_requests_total", status="429") == counts["rejected"]
    assert delta("sightline_requests_total", status="504") == counts.get("timed_out", 0)
    assert delta("sightline_requests_shed_total") == counts["rejected"]
    assert delta("sightline_requests_total") == sent  # completed + rejected + errored + aborted
    rss = value(after, "sightline_process_resident_memory_bytes", role="main")
    assert rss < 2.5e9, rss


def test_body_size_limit(server):
    r = server.post("/v1/completions", {"prompt": "x" * 30000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert server.post("/v1/completions", {"prompt": "small", "max_tokens": 2}).status_code == 200
