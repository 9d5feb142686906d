"""Event-loop lag: the monitor on a real loop, its stalls on the request's span, its metric per process."""

from __future__ import annotations

import asyncio
import time

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serving.args import ServerArgs
from serving.frontend.stack import front_telemetry
from serving.frontend.tokenizer_manager.req_state import ReqState
from telemetry.clock import now_ns
from telemetry.loop_lag import LoopLagMonitor
from telemetry.request_telemetry import RequestTelemetry
from telemetry.timeline import Timeline
from telemetry.tracing import Tracing

ATTR = "sightline.event_loop.lag_max_seconds"


def test_a_blocked_loop_is_measured_and_remembered_with_when():
    async def scenario() -> tuple[LoopLagMonitor, list[float], int, int, int]:
        observed: list[float] = []
        lag = LoopLagMonitor(observed.append, interval=0.01, slow=0.15)
        lag.start()
        await asyncio.sleep(0.05)
        before = now_ns()
        await asyncio.sleep(0.05)
        start = now_ns()
        time.sleep(0.3)  # a callback that holds the loop
        await asyncio.sleep(0.05)  # the monitor wakes, 0.3 s late
        end = now_ns()
        await lag.stop()
        return lag, observed, before, start, end

    lag, observed, before, start, end = asyncio.run(scenario())
    assert max(observed) >= 0.25 and lag.worst == max(observed)
    assert all(v > lag.slow for _, v in lag.stalls) and len(observed) > len(lag.stalls)  # only stalls are kept
    [(at, stall)] = [(t, v) for t, v in lag.stalls if v >= 0.25]
    assert start <= at <= end and stall >= 0.25
    assert lag.worst_between(start, end) == stall
    # the stall began after that window (its lag counts from when the monitor asked to wake: at most one
    # sampling interval before the blocking call, when both were due in the same loop iteration)
    assert lag.worst_between(before, start - 20_000_000) is None
    assert lag.worst_between(at + 1, end) is None  # ... and ended before this one


def test_stalls_kept_are_bounded_and_matched_by_overlap():
    lag = LoopLagMonitor(None, slow=0.1, keep=3)
    s = 1_000_000_000
    for i, value in enumerate([0.2, 0.05, 0.5, 0.3, 0.4]):
        lag.record((i + 1) * 10 * s, value)  # at 10 s, 20 s...; 0.05 is not a stall
    assert [v for _, v in lag.stalls] == [0.5, 0.3, 0.4]  # the oldest stall went first
    assert lag.worst_between(0, 100 * s) == 0.5
    assert lag.worst_between(int(39.5 * s), int(39.8 * s)) == 0.3  # within the stall that ended at 40 s
    assert lag.worst_between(int(40.1 * s), int(49.0 * s)) is None
    assert lag.worst_between(int(49.7 * s), 60 * s) == 0.4  # the stall over [49.6 s, 50 s]


def _server_spans(exporter: InMemorySpanExporter) -> dict[str, dict]:
    return {
        s.attributes["sightline.rid"]: dict(s.attributes)
        for s in exporter.get_finished_spans()
        if s.name == "POST /v1/completions"
    }


def test_the_server_span_carries_the_worst_stall_during_its_request():
    exporter = InMemorySpanExporter()

    async def scenario() -> None:
        lag = LoopLagMonitor(None, interval=0.01, slow=0.15)  # above what a loaded test machine adds
        tracing = Tracing("main", instance_id="test")
        tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
        tel = RequestTelemetry(tracing, None, Timeline(10), "m", False, lag)
        lag.start()
        await asyncio.sleep(0.05)

        async def request(rid: str, block: float, wait_after: bool) -> None:
            rt = ReqState(route="/v1/completions", operation="text_completion", arrival=now_ns(), rid=rid)
            tel.begin(rt, {}, "POST", {})
            tel.tokenized(rt, rt.arrival, now_ns())
            await asyncio.sleep(0.03)
            time.sleep(block)
            if wait_after:
                await asyncio.sleep(0.05)  # the monitor has sampled the stall
            tel.finish(rt, "stop", None, None)  # else: it ends before the monitor's task runs again
            tel.end(rt, 200)

        await request("blocked", 0.3, wait_after=True)
        await request("fine", 0.0, wait_after=True)
        await request("ends-in-the-stall", 0.25, wait_after=False)
        await lag.stop()
        tracing.shutdown()

    asyncio.run(scenario())
    spans = _server_spans(exporter)
    assert 0.25 <= spans["blocked"][ATTR] < 1.0
    assert ATTR not in spans["fine"]  # the earlier stall ended before it arrived
    assert 0.2 <= spans["ends-in-the-stall"][ATTR] < 1.0


def test_each_front_end_process_observes_its_own_lag_series():
    args = ServerArgs(model="tiny-random")
    for role in ("main", "worker-2"):
        tel, _, metrics = front_telemetry(args, "m", "instance", role=role)
        tel.loop_lag.record(now_ns(), 0.2)
        assert metrics.registry.get_sample_value("sightline_event_loop_lag_seconds_count", {"role": role}) == 1
        assert (
            metrics.registry.get_sample_value("sightline_event_loop_lag_seconds_bucket", {"role": role, "le": "0.1"})
            == 0
        )
        tel.tracing.shutdown()


def test_the_hub_keeps_each_workers_lag_apart():
    """Histograms are summed over workers by label set: the role label keeps one series per worker."""
    from telemetry.metrics import Metrics
    from telemetry.registry_merge import Retired, merge, registry_of, snapshot

    workers = {}
    for w, lag in ((1, 0.02), (2, 0.3)):
        m = Metrics("m")
        m.loop_lag.labels(f"worker-{w}").observe(lag)
        workers[w] = snapshot(m.registry)
    merged = registry_of(merge(snapshot(Metrics("m", hub=True).registry), workers, Retired()))
    for role, over in (("worker-1", 0), ("worker-2", 1)):
        count = merged.get_sample_value("sightline_event_loop_lag_seconds_count", {"role": role})
        fast = merged.get_sample_value("sightline_event_loop_lag_seconds_bucket", {"role": role, "le": "0.1"})
        assert (count, count - fast) == (1, over), role
