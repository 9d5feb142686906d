"""Clients that set no max_tokens (the openai client's default) on the bundled model, default flags.

Admission on the estimate lets 16 such streams run at once (reserving the context window,
8,192 slots each in a 32,768-slot pool, allowed 4), and the front end's token limit charges
the same estimate, so 64 of them are all accepted (charged the context window, the 17th got
429 tokens_full).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server_util import ServerProc, scrape, value

pytestmark = pytest.mark.smollm


@pytest.fixture(scope="module")
def smollm_server(tmp_path_factory):
    srv = ServerProc(model="smollm2-135m", tmpdir=tmp_path_factory.mktemp("admission-server"))
    yield srv
    srv.stop()


def chat(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Write a long story about a lighthouse keeper named {i}."}],
        "stream": True,
    }


async def open_streams(url: str, n: int, until, timeout: float = 180.0) -> tuple[list[int], object]:
    """Open `n` streaming chats at once, wait until `until()` returns a value (or time runs out), then
    disconnect them all (the server aborts them); returns the HTTP statuses and that value."""
    statuses: list[int] = []
    started = asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=chat(i)) as r:
            statuses.append(r.status_code)
            if len(statuses) == n:
                started.set()
            async for _ in r.aiter_lines():
                pass

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=n + 4)) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            got = await asyncio.to_thread(until)
            if got is not None and started.is_set():
                break
            await asyncio.sleep(0.2)  # clock: the poll interval
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return statuses, got


def test_16_clients_without_max_tokens_run_at_once(smollm_server):
    peak = [0.0]

    def running() -> float | None:
        peak[0] = max(peak[0], value(scrape(smollm_server), "sightline_num_requests_running"))
        return peak[0] if peak[0] >= 15 else None

    statuses, got = asyncio.run(open_streams(smollm_server.url, 16, running))
    assert statuses == [200] * 16
    assert got is not None and got >= 15, f"at most {peak[0]:.0f} of 16 ran at once"


def test_64_clients_without_max_tokens_get_no_429(smollm_server):
    def shed() -> float:
        return value(scrape(smollm_server), "sightline_requests_shed_total", reason="tokens_full")

    before = shed()
    statuses, _ = asyncio.run(open_streams(smollm_server.url, 64, lambda: True))
    assert sorted(statuses) == [200] * 64, sorted(statuses)
    assert shed() == before
