"""Requests whose clients vanish at random moments: nothing leaks anywhere, and a closed
connection stops counting against --max-connections at once.

A client that is to leave sends a held request (tests.server_util.HOLD): it can never finish
before its client goes, so which requests end how is known in advance and every count is exact."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx

from tests.server_util import HOLD, ServerProc, scrape, value, wait_until


@dataclass(frozen=True)
class Client:
    """One request of a storm and when its client goes: `leave` None (it waits for the answer), a
    number of seconds (counted from its response headers when `after_headers`, else from the start),
    or "held" (once every "held" request of the storm is held)."""

    stream: bool
    max_tokens: int
    leave: float | str | None
    after_headers: bool = False

    def body(self, i: int) -> dict:
        held = HOLD if self.leave is not None else {}  # a leaver's request runs until its client goes
        return {
            "prompt": f"storm {i}",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": self.stream,
            **held,
        }


async def _one(c: httpx.AsyncClient, i: int, client: Client, all_held: asyncio.Event) -> str:
    body = client.body(i)

    async def send() -> int:
        if not client.stream:
            return (await c.post("/v1/completions", json=body)).status_code
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if client.after_headers and r.status_code == 200:  # the request reached the front end: the clock starts
                await asyncio.sleep(client.leave)  # clock: the moment this client picked to leave
                return -1
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    try:
        if client.leave == "held":
            request, gone = asyncio.ensure_future(send()), asyncio.ensure_future(all_held.wait())
            await asyncio.wait({request, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not request.done():
                request.cancel()  # the connection closes: the server aborts the request
                return "left"
            status = request.result()
        elif client.leave is None or client.after_headers:
            status = await send()
        else:
            async with asyncio.timeout(client.leave):
                status = await send()
        return "left" if status == -1 else "finished" if status == 200 else f"status {status}"
    except TimeoutError:
        return "left"
    except httpx.HTTPError as exc:  # e.g. a connection refused by --max-connections
        return f"error {type(exc).__name__}"


def storm(url: str, clients: list[Client], when_held=None) -> list[str]:
    """The clients' requests all at once on one client; its connections all close when it returns.
    "held" leavers go once the others have ended and `when_held()` (run in a thread) returns."""

    async def main():
        all_held = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=300)) as c:
            tasks = [asyncio.ensure_future(_one(c, i, cl, all_held)) for i, cl in enumerate(clients)]
            await asyncio.gather(*(t for t, cl in zip(tasks, clients) if cl.leave != "held"))
            if when_held is not None:
                await asyncio.to_thread(when_held)
            all_held.set()
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


def idle(server) -> tuple[bool, dict]:
    """Whether no request state is left in the front end, the Scheduler or the Detokenizer (after a
    barrier: the engine's latest stats)."""
    server.barrier()
    st = server.debug()
    sched, detok = st["scheduler"], st["detokenizer"]
    done = (
        st["in_flight"] == 0
        and sched["num_running"] == 0
        and sched["num_waiting"] == 0
        and sched["kv_used"] == sched["prefix_cached_tokens"]
        and sched["kv_reserved"] == 0
        and detok["active_rids"] == 0
    )
    return done, st


def _aborts(server) -> float:
    return value(scrape(server), "sightline_request_aborts_total", reason="client_disconnect")


def test_disconnect_storm_leaves_no_state(tiny_server):
    """200 clients at once: a fifth wait for their answers; streamed leavers go at a random moment
    after their response started (0 to 0.6 s: mid-stream, or once held); non-streamed leavers go
    together once all of them are held.  Every leaver's request is aborted exactly once."""
    rng = random.Random(7)
    clients = []
    for _ in range(200):
        stream, leave = rng.random() < 0.7, rng.choice((0.0, 0.05, 0.2, 0.6, None))
        tokens = rng.choice((4, 16, 32))
        if leave is None:
            clients.append(Client(stream, tokens, None))
        else:
            clients.append(Client(True, tokens, leave, after_headers=True) if stream else Client(False, tokens, "held"))
    streamed_leavers = sum(c.after_headers for c in clients)
    held_leavers = sum(c.leave == "held" for c in clients)
    finishers = len(clients) - streamed_leavers - held_leavers
    # held requests keep their batch place (--max-running-requests 64): the others still need room
    assert held_leavers <= 48 and finishers >= 20 and streamed_leavers >= 60, (held_leavers, finishers)

    tiny_server.barrier()
    before = scrape(tiny_server)
    aborts_before = _aborts(tiny_server)

    def when_held() -> None:
        # every streamed leaver's abort is counted (the held leavers cannot be aborted yet), then
        # the Scheduler holds exactly the held leavers
        wait_until(
            lambda: _aborts(tiny_server) - aborts_before == streamed_leavers, 20, "an abort for each streamed leaver"
        )
        tiny_server.wait_held(held_leavers)

    outcomes = storm(tiny_server.url, clients, when_held)
    expected = ["finished" if c.leave is None else "left" for c in clients]
    assert outcomes == expected, [(c, o) for c, o, e in zip(clients, outcomes, expected) if o != e]
    wait_until(
        lambda: _aborts(tiny_server) - aborts_before == streamed_leavers + held_leavers, 20, "an abort for each leaver"
    )
    done, st = idle(tiny_server)  # the aborts were sent before the barrier: the engine has handled them
    sched, detok = st["scheduler"], st["detokenizer"]
    assert st["in_flight"] == 0, st  # no leaked ReqState
    assert (
        sched["kv_used"] == sched["prefix_cached_tokens"]
        and sched["kv_reserved"] == 0
        and sched["num_running"] == 0
        and sched["num_waiting"] == 0
        and sched["held"] == 0
    ), sched
    assert detok["active_rids"] == 0, detok  # the Detokenizer dropped every rid's state too
    assert done
    after = scrape(tiny_server)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    aborts = delta("sightline_request_aborts_total", reason="client_disconnect")
    drops = delta("sightline_stale_messages_dropped_total")
    # each aborted request's final output (and any token sent after its client left) arrives after
    # the front end forgot it
    assert aborts == streamed_leavers + held_leavers and drops >= aborts, (drops, aborts)
    assert delta("sightline_requests_total", status="499") == aborts
    assert delta("sightline_requests_total", status="200") == finishers
    assert httpx.get(tiny_server.url + "/health").status_code == 200


def test_disconnect_storm_rounds_free_their_connections(tmp_path):
    """20 storms in a row on a server allowing 32 connections that keeps idle ones 120 s: each
    round's closed connections must leave the count before the next round needs the room.  A
    leaver goes 0, 50 or 200 ms after it started sending (perhaps before its request arrived)."""
    server = ServerProc("--max-connections", "32", "--keep-alive-timeout", "120", tmpdir=tmp_path)
    rng = random.Random(11)
    try:
        for round_no in range(20):
            clients = [
                Client(rng.random() < 0.7, rng.choice((4, 16, 32)), rng.choice((0.0, 0.05, 0.2, None)))
                for _ in range(20)
            ]
            outcomes = storm(server.url, clients)
            assert outcomes == ["finished" if c.leave is None else "left" for c in clients], (round_no, outcomes)
            # the scrape's own connection is the one left open
            wait_until(
                lambda: value(scrape(server), "sightline_http_connections_open") <= 1,
                10,
                f"round {round_no}'s closed connections to leave the count",
            )
        wait_until(lambda: idle(server)[0], 20, "no request state left")
        assert server.held() == 0
        assert value(scrape(server), "sightline_http_connections_refused_total") == 0
    finally:
        assert server.stop() == 0
