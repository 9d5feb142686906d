"""Requests whose clients vanish at random moments: nothing leaks anywhere, and a closed
connection stops counting against --max-connections at once."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from tests.server_util import ServerProc, scrape, value, wait_until


async def _one(c: httpx.AsyncClient, rng: random.Random, i: int, leave: tuple[float, ...],
               lengths: tuple[int, ...]) -> str:
    stream = rng.random() < 0.7
    body = {"prompt": f"storm {i}", "max_tokens": rng.choice(lengths), "ignore_eos": True, "stream": stream}
    leave_after = rng.choice(leave)
    try:
        async with asyncio.timeout(leave_after):
            if stream:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    status = r.status_code
                    async for _ in r.aiter_lines():
                        pass
            else:
                status = (await c.post("/v1/completions", json=body)).status_code
        return "finished" if status == 200 else f"status {status}"
    except TimeoutError:
        return "left"
    except httpx.HTTPError as exc:  # e.g. a connection refused by --max-connections
        return f"error {type(exc).__name__}"


def storm(url: str, n: int, rng: random.Random, leave: tuple[float, ...] = (0.0, 0.05, 0.2, 0.6, 30.0),
          lengths: tuple[int, ...] = (4, 64, 400)) -> list[str]:
    """n concurrent requests on one client, each left after a random time; the client's
    connections all close when it returns."""
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=300)) as c:
            return await asyncio.gather(*(_one(c, rng, i, leave, lengths) for i in range(n)))

    return asyncio.run(main())


def idle(server) -> tuple[bool, dict]:
    """Whether no request state is left in the front end, the Scheduler or the Detokenizer."""
    st = server.debug()
    sched, detok = st["scheduler"], st["detokenizer"]
    done = (st["in_flight"] == 0 and sched["num_running"] == 0 and sched["num_waiting"] == 0 and
            sched["kv_used"] == sched["prefix_cached_tokens"] and sched["kv_reserved"] == 0 and
            detok["active_rids"] == 0)
    return done, st


def test_disconnect_storm_leaves_no_state(tiny_server):
    before = scrape(tiny_server)
    outcomes = storm(tiny_server.url, 200, random.Random(7))
    assert outcomes.count("left") >= 60 and outcomes.count("finished") >= 20
    deadline = time.monotonic() + 20
    while not (done := idle(tiny_server))[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    st = done[1]
    sched, detok = st["scheduler"], st["detokenizer"]
    assert st["in_flight"] == 0, st  # no leaked ReqState
    assert (sched["kv_used"] == sched["prefix_cached_tokens"] and sched["kv_reserved"] == 0
            and sched["num_running"] == 0), sched
    assert detok["active_rids"] == 0, detok  # the Detokenizer dropped every rid's state too
    after = scrape(tiny_server)
    drops = value(after, "sightline_stale_messages_dropped_total") - value(before,
                                                                           "sightline_stale_messages_dropped_total")
    aborts = value(after, "sightline_request_aborts_total", reason="client_disconnect") - value(
        before, "sightline_request_aborts_total", reason="client_disconnect")
    # clients that left before their request reached the server cause no abort; the others each one
    assert drops > 0 and 20 <= aborts <= outcomes.count("left"), (drops, aborts)
    gone = value(after, "sightline_requests_total", status="499") - value(before, "sightline_requests_total",
                                                                          status="499")
    assert gone == aborts
    assert httpx.get(tiny_server.url + "/health").status_code == 200


def test_disconnect_storm_rounds_free_their_connections(tmp_path):
    """20 storms in a row on a server allowing 32 connections that keeps idle ones 120 s: each
    round's closed connections must leave the count before the next round needs the room."""
    server = ServerProc("--max-connections", "32", "--keep-alive-timeout", "120", tmpdir=tmp_path)
    rng = random.Random(11)
    try:
        for round_no in range(20):
            outcomes = storm(server.url, 20, rng, leave=(0.0, 0.05, 0.2, 10.0), lengths=(4, 16, 32))
            assert all(o in ("left", "finished") for o in outcomes), (round_no, outcomes)
            # the scrape's own connection is the one left open
            wait_until(lambda: value(scrape(server), "sightline_http_connections_open") <= 1, 10,
                       f"round {round_no}'s closed connections to leave the count")
        wait_until(lambda: idle(server)[0], 20, "no request state left")
        assert value(scrape(server), "sightline_http_connections_refused_total") == 0
    finally:
        assert server.stop() == 0
