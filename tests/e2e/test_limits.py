"""Timeouts, overload shedding and body limits, against a real server (tiny-random).  The requests a
limit must find running are held (tests.server_util.HOLD): they keep their batch place until cut or released."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server_util import HOLD, ServerProc, scrape, sse_events, value, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "6",
        "--max-queue-time",
        "1.5",
        "--max-request-bytes",
        "20000",
        tmpdir=tmp_path_factory.mktemp("limits"),
    )
    yield srv
    srv.stop()


def wait_idle(srv: ServerProc, timeout: float = 20.0) -> dict:
    """/debug/state once nothing is in flight at the front end, and the engine (its stats in) is idle."""

    def idle():
        srv.barrier()
        st = srv.debug()
        sched = st["scheduler"]
        return (
            st
            if (
                st["in_flight"] == 0
                and sched["num_running"] == 0
                and sched["num_waiting"] == 0
                and sched["kv_used"] == sched["prefix_cached_tokens"]
            )
            else None
        )

    return wait_until(idle, timeout, "the server to go idle")


HELD = {"prompt": "go on", "max_tokens": 8, **HOLD}  # stays running, one token short, until cut or released


def test_request_timeout_header_aborts_down_to_the_scheduler(server):
    t0 = time.monotonic()
    r = server.post("/v1/completions", HELD, headers={"x-request-timeout": "0.5"})
    took = time.monotonic() - t0
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
    assert 0.4 < took < 3.0
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={**HELD, "stream": True},
        headers={"x-request-timeout": "0.5"},
        timeout=30,
    ) as s:
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
            # two held requests fill --max-running-requests 2; the third waits and expires
            blockers = [asyncio.create_task(c.post("/v1/completions", json=HELD)) for _ in range(2)]
            await asyncio.to_thread(server.wait_held, 2)
            t0 = time.monotonic()
            waiting = await c.post("/v1/completions", json={"prompt": "queued", "max_tokens": 4})
            took = time.monotonic() - t0
            assert server.held() == 2  # both slots taken all along
            for b in blockers:
                b.cancel()
            await asyncio.gather(*blockers, return_exceptions=True)
            return waiting, took

    r, took = asyncio.run(main())
    assert r.status_code == 504 and "queue" in r.json()["error"]["message"], r.text
    assert 1.5 <= took < 5.0, took  # --max-queue-time 1.5
    wait_idle(server)


def test_overload_sheds_with_429_and_accounting_reconciles(server):
    """Two held requests fill --max-running-requests 2; of 40 more sent at once, 6 fill
    --max-queued-requests and time out after --max-queue-time, the other 34 are shed with 429;
    then the held two are released and finish.  The metrics count exactly that."""
    before = scrape(server)
    sent, queued = 40, 6

    async def one(c: httpx.AsyncClient, i: int) -> str:
        r = await c.post("/v1/completions", json={"prompt": f"load {i}", "max_tokens": 24, "ignore_eos": True})
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "overloaded_error"
            assert r.json()["error"]["code"] == "queue_full", r.text
            return "rejected"
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 24
            return "completed"
        if r.status_code == 504:  # waited longer than --max-queue-time: an explicit timeout
            assert "queue" in r.json()["error"]["message"], r.text
            return "timed_out"
        return f"other {r.status_code}"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=100)) as c:
            blockers = [asyncio.create_task(c.post("/v1/completions", json=HELD)) for _ in range(2)]
            await asyncio.to_thread(server.wait_held, 2)
            outcomes = await asyncio.gather(*(one(c, i) for i in range(sent)))
            assert server.held() == 2  # the queue never moved
            server.release()
            return outcomes, await asyncio.gather(*blockers)

    outcomes, blocked = asyncio.run(main())
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    assert counts == {"rejected": sent - queued, "timed_out": queued}, counts
    assert all(
        b.status_code == 200 and b.json()["usage"]["completion_tokens"] == HELD["max_tokens"] for b in blocked
    ), [b.text for b in blocked]
    wait_idle(server)
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("sightline_requests_total", status="200") == len(blocked)
    assert delta("sightline_requests_total", status="429") == counts["rejected"]
    assert delta("sightline_requests_total", status="504") == counts["timed_out"]
    assert delta("sightline_requests_shed_total") == counts["rejected"]
    assert delta("sightline_requests_total") == sent + len(blocked)  # completed + rejected + errored + aborted
    rss = value(after, "sightline_process_resident_memory_bytes", role="main")
    assert rss < 2.5e9, rss


def test_body_size_limit(server):
    r = server.post("/v1/completions", {"prompt": "x" * 30000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert server.post("/v1/completions", {"prompt": "small", "max_tokens": 2}).status_code == 200
