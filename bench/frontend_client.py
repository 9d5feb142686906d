"""bench.frontend's capacity client, a process of its own: raw keep-alive HTTP/1.1 requests,
each one token, kept in flight; what completed in the measured window and its own CPU seconds."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from collections import Counter

from bench.common import completion_body
from loadtest.server import auth_headers


def capacity_prompts(n: int) -> list[str]:
    """A few words each (about 5–8 tokens), no two alike."""
    return [f"Request {i}: say hello." for i in range(n)]


def capacity_body(prompt: str) -> dict:
    """A non-streaming `/v1/completions` request for exactly one token (bench/common.py's `completion_body`)."""
    body = completion_body(prompt, 1)
    body.pop("stream_options")
    return {**body, "stream": False}


class RawHTTP:
    """One keep-alive HTTP/1.1 connection, bytes in and out: a few tens of µs of client CPU per
    request where httpx spends milliseconds, so that on 2 cores the server, not the load
    generator, is what runs out (the front end answers JSON with a content-length)."""

    def __init__(self, url: str) -> None:
        host, port = url.split("//", 1)[1].split(":")
        self.host, self.port = host, int(port)
        self.auth = "".join(f"{k}: {v}\r\n" for k, v in auth_headers().items())
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{self.auth}\r\n".encode()
            + body
        )
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            return status, await reader.readexactly(length)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


async def drive(url: str, concurrency: int, first: int, start_at: float, end_at: float) -> dict:
    """`concurrency` loops, each on its own keep-alive connection sending the next request as soon
    as its last one is answered, until `end_at` (time.time()); what completed in [start_at, end_at),
    and this process's CPU seconds (getrusage) over that window."""
    prompts = capacity_prompts(4 * concurrency)
    lat: list[float] = []
    errors: Counter = Counter()
    cpu: list[float] = []

    async def meter() -> None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu.append(own_cpu_seconds())
        await asyncio.sleep(max(0.0, end_at - time.time()))
        cpu.append(own_cpu_seconds())

    async def loop(k: int) -> None:
        i, conn = k, RawHTTP(url)
        while time.time() < end_at:
            body = json.dumps(capacity_body(prompts[i % len(prompts)])).encode()
            t0 = time.perf_counter()
            try:
                status, data = await conn.post("/v1/completions", body)
                error = None if status == 200 and b'"choices"' in data else f"HTTP {status}"
            except (OSError, ValueError, StopIteration, asyncio.IncompleteReadError) as exc:
                error = type(exc).__name__
            t1, now = time.perf_counter(), time.time()
            if start_at <= now < end_at:
                if error is None:
                    lat.append(t1 - t0)
                else:
                    errors[error] += 1
            i += concurrency
        conn.close()

    await asyncio.gather(meter(), *(loop(first + k) for k in range(concurrency)))
    return {"latency_s": lat, "errors": dict(errors), "cpu_s": cpu[1] - cpu[0]}


def client_main(url: str, concurrency: int, first: int, ready, go, start_at, duration_s: float, results) -> None:
    """A client process: says it is ready, waits for the start time, drives, sends its results."""
    ready.put(os.getpid())
    go.wait()
    results.put(asyncio.run(drive(url, concurrency, first, start_at.value, start_at.value + duration_s)))


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
