"""200 requests whose clients vanish at random moments: nothing leaks anywhere."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from tests.server_util import scrape, value


def test_disconnect_storm_leaves_no_state(tiny_server):
    before = scrape(tiny_server)
    rng = random.Random(7)

    async def one(c: httpx.AsyncClient, i: int) -> str:
        stream = rng.random() < 0.7
        body = {"prompt": f"storm {i}", "max_tokens": rng.choice([4, 64, 400]), "ignore_eos": True, "stream": stream}
        leave_after = rng.choice([0.0, 0.05, 0.2, 0.6, 30.0])
        try:
            async with asyncio.timeout(leave_after):
                if stream:
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    await c.post("/v1/completions", json=body)
            return "finished"
        except TimeoutError:
            return "left"

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=300)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(200)))

    outcomes = asyncio.run(main())
    assert outcomes.count("left") >= 60 and outcomes.count("finished") >= 20
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = tiny_server.debug()
        sched, detok = st["scheduler"], st["detokenizer"]
        if (st["in_flight"] == 0 and sched["num_running"] == 0 and sched["num_waiting"] == 0 and
                sched["kv_used"] == sched["prefix_cached_tokens"] and sched["kv_reserved"] == 0 and
                detok["active_rids"] == 0):
            break
        time.sleep(0.2)
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
