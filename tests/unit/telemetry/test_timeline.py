"""The in-memory timeline behind /debug/requests: bounded, newest kept."""

from __future__ import annotations

from protocol.io_struct import SpanRecord
from telemetry.timeline import Timeline


def test_the_timeline_keeps_the_latest_finished_requests_and_forgets_the_oldest():
    t = Timeline(2)
    for i in range(3):
        t.add_span(
            SpanRecord(name="http", trace_id=f"{i:032x}", span_id=f"{i:016x}", start_ns=i, end_ns=i + 1, kind="SERVER")
        )
        t.finish(f"{i:032x}", {"rid": f"r{i}"})
    assert t.get("r0") is None and t.get("r1")["trace_id"] == f"{1:032x}" and len(t.get("r2")["spans"]) == 1
    assert [e["rid"] for e in t.recent()] == ["r2", "r1"]
