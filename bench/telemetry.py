"""Telemetry overhead: the same load with telemetry fully on vs fully off, alternating.

    .venv/bin/python -m bench.telemetry [--model smollm2-135m] [--rounds 2]

"on":  spans for every request (sampling 1.0) exported over OTLP/HTTP to a receiver in
       this script, metrics observed, /metrics scraped every second, one JSON log line
       per request.
"off": --no-enable-tracing --no-enable-metrics --no-log-requests.
"head-0.01" / "tail-0.01": as "on" with head sampling at 1 %, tail sampling off / on (the
       cost of recording every request for the tail decision; `--modes head-0.01,tail-0.01`).
Each round starts a fresh server per mode and measures (1) p50 TTFT of sequential
single requests and (2) output tokens/s of `--concurrency` concurrent streams.
On a shared 2-core machine those end-to-end numbers move ±10 % run to run, more than
the effect measured, so `--micro` also times the main process's telemetry work itself
(spans, histograms with exemplars, counters, timeline) per request and per token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from bench.common import http_one, http_run, make_prompts, start_server
from serving.model_files import load_tokenizer

MODES = {
    "on": lambda sink: [
        "--otel-traces-exporter",
        "otlp",
        "--otel-exporter-otlp-endpoint",
        sink,
        "--otel-sampling-ratio",
        "1.0",
        "--log-requests",
    ],
    "off": lambda sink: ["--no-enable-tracing", "--no-enable-metrics", "--no-log-requests"],
    "head-0.01": lambda sink: [
        "--otel-traces-exporter",
        "otlp",
        "--otel-exporter-otlp-endpoint",
        sink,
        "--otel-sampling-ratio",
        "0.01",
        "--log-requests",
        "--no-otel-tail-sampling",
    ],
    "tail-0.01": lambda sink: [
        "--otel-traces-exporter",
        "otlp",
        "--otel-exporter-otlp-endpoint",
        sink,
        "--otel-sampling-ratio",
        "0.01",
        "--log-requests",
    ],
}


class Sink(BaseHTTPRequestHandler):
    """Accepts OTLP exports (and counts their bytes) so the exporter does its full work."""

    received = 0

    def do_POST(self):
        Sink.received += len(self.rfile.read(int(self.headers.get("content-length", 0))))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


async def ttft_p50(url: str, prompts: list[list[int]]) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        ttfts = [(await http_one(client, ids, 8))[0] for ids in prompts]
    return statistics.median(ttfts)


async def scraper(url: str, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            await client.get("/metrics", headers={"accept": "application/openmetrics-text"})
            await asyncio.sleep(1.0)


async def measure(url: str, mode: str, seq: list[list[int]], conc: list[list[int]], gen_len: int) -> dict:
    stop = asyncio.Event()
    task = asyncio.create_task(scraper(url, stop)) if mode != "off" else None
    p50 = await ttft_p50(url, seq)
    tput = (await http_run(url, conc, gen_len))["tok_s"]
    stop.set()
    if task:
        await task
    return {"ttft_p50_ms": p50, "tok_s": tput}


def micro(requests: int = 300, tokens: int = 64) -> None:
    """CPU cost of the main process's per-request telemetry, on vs off, without any server."""
    from protocol.io_struct import BatchStrOutput, ReqMeta, Stamps, StrOut
    from serving.frontend.tokenizer_manager.req_state import ReqState
    from telemetry.clock import now_ns
    from telemetry.metrics import Metrics
    from telemetry.request_telemetry import RequestTelemetry
    from telemetry.tail_sampling import TailSampler
    from telemetry.timeline import Timeline
    from telemetry.tracing import Tracing

    def run(enabled: bool, ratio: float = 1.0, tail: bool = False) -> float:
        timeline = Timeline(500)
        sampler = TailSampler([], {}, 4096) if tail else None
        sink = (lambda rec: (timeline.add_span(rec), sampler.add(rec))) if tail else timeline.add_span
        tel = RequestTelemetry(
            Tracing("main", enabled=enabled, sink=sink, ratio=ratio, tail=tail),
            Metrics("m") if enabled else None,
            timeline,
            "m",
            False,
        )
        tel.tail = sampler
        t0 = time.perf_counter()
        for i in range(requests):
            rt = ReqState(
                route="/v1/completions", operation="text_completion", arrival=now_ns(), rid=f"r{i}", prompt_tokens=10
            )
            tel.begin(rt, {}, "POST", {})
            tel.tokenized(rt, now_ns(), now_ns())
            carrier, producer = tel.producer(rt)
            if producer is not None:
                producer.end()
            t = now_ns()
            st = Stamps(
                arrival=rt.arrival,
                tokenized=t,
                sched_recv=t,
                scheduled=t,
                first_token=t,
                detok_recv=t,
                detok_done=t,
                sched_sent=t,
                waited=6000,
                wait_reasons={"running_limit": 5000, "next_step": 1000},
            )  # as a request that waited
            for k in range(tokens):
                out = StrOut(rid=f"r{i}", text="x", output_ids=[1], meta=ReqMeta(trace=carrier, stamps=st))
                tel.on_batch(BatchStrOutput(outputs=[out], sent_at=now_ns()), now_ns())
                rt.meta, rt.completion_tokens = out.meta, k + 1
                tel.on_output(rt, out, now_ns())
            st.finished = now_ns()
            tel.finish(rt, "length", None, None)
            tel.end(rt, 200)
        return (time.perf_counter() - t0) / requests * 1e6

    on, off = run(True), run(False)
    print(
        f"main-process telemetry, per request of {tokens} tokens: on {on:.0f} µs, off {off:.0f} µs "
        f"→ {on - off:.0f} µs per request, {(on - off) / tokens:.1f} µs per token"
    )
    head, tail = run(True, 0.01), run(True, 0.01, tail=True)
    print(
        f"with head sampling at 1 %: tail sampling off {head:.0f} µs, on {tail:.0f} µs per request "
        f"(every request recorded and decided: +{tail - head:.0f} µs)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--ttft-requests", type=int, default=20)
    ap.add_argument("--port", type=int, default=8392)
    ap.add_argument("--micro", action="store_true", help="only time the telemetry code itself (no server)")
    ap.add_argument("--modes", default="on,off", help=f"two of {','.join(MODES)}, compared")
    a = ap.parse_args()
    if a.micro:
        micro()
        return
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}"
    tok, _ = load_tokenizer(a.model)

    class _M:  # make_prompts only needs .tokenizer
        tokenizer = tok

    seq = make_prompts(_M, a.ttft_requests, 64)
    conc = make_prompts(_M, a.concurrency, 128)
    modes = tuple(a.modes.split(","))
    assert len(modes) == 2 and all(m in MODES for m in modes), f"--modes: two of {list(MODES)}"
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                server = start_server(a.model, a.port, Path(tmp) / "server.log", MODES[mode](sink_url))
                try:
                    asyncio.run(http_run(server.url, conc[:2], 4))  # warm-up
                    results[mode].append(asyncio.run(measure(server.url, mode, seq, conc, a.gen_len)))
                finally:
                    server.stop()
            print(f"round {r} {mode}: {results[mode][-1]}", flush=True)
    print(
        f"\nmodel {a.model}, {os.cpu_count()} CPUs, {a.rounds} rounds (medians); OTLP bytes received: {Sink.received}"
    )
    print(
        "| telemetry | p50 TTFT ms (sequential, 64-token prompts) | output tok/s "
        f"({a.concurrency} streams × {a.gen_len}) |\n|---|---:|---:|"
    )
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in results.items()}
    base, other = modes[::-1] if modes[0] == "on" else modes  # "on,off" reads as on over off
    for m in (base, other):
        print(f"| {m} | {med[m]['ttft_p50_ms']:.2f} | {med[m]['tok_s']:.1f} |")
    print(
        f"| {other} − {base} | {med[other]['ttft_p50_ms'] - med[base]['ttft_p50_ms']:+.2f} ms | "
        f"{100 * (med[other]['tok_s'] / med[base]['tok_s'] - 1):+.1f}% |"
    )


if __name__ == "__main__":
    main()
