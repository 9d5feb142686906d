"""Tail sampling's parts with a real tracer and real OTel SDK span processors: the sampler's
cases, the buffer and its bound, late spans following a decision, the export with each
origin's resource, and the outcome vocabulary it decides on."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context

from protocol.io_struct import SpanRecord
from telemetry import outcomes
from telemetry.tail_sampling import TailPolicy, TailSampler, slo_policy
from telemetry.tracing import TAIL_KEY, Tracing, tail_trace_id_of, trace_id_of


def record(trace: str, span: str, sampled: bool = False, **kw) -> SpanRecord:
    return SpanRecord(
        name=kw.pop("name", "s"), trace_id=trace, span_id=span, start_ns=1, end_ns=2, sampled=sampled, **kw
    )


def sampler(max_traces: int = 8):
    exp, counts = InMemorySpanExporter(), []
    tail = TailSampler(
        [SimpleSpanProcessor(exp)],
        {"service.name": "sightline", "service.instance.id": "i"},
        max_traces,
        lambda d, r: counts.append((d, r)),
    )
    return tail, exp, counts


def test_the_front_end_records_unsampled_roots_and_marks_their_carrier():
    records: list[SpanRecord] = []
    tr = Tracing("main", ratio=0.0, tail=True, sink=records.append)
    span = tr.start("POST /v1/completions", None, kind=SpanKind.SERVER)
    assert span.is_recording() and trace_id_of(span) is None and tail_trace_id_of(span)
    assert tr.carrier(span)[TAIL_KEY] == "1"
    tr.record("tokenize", set_span_in_context(span), 1, 2)
    assert [(r.name, r.sampled) for r in records] == [("tokenize", False)]


def test_without_tail_nothing_unsampled_is_recorded():
    tr = Tracing("main", ratio=0.0, tail=False)
    span = tr.start("POST /v1/completions", None, kind=SpanKind.SERVER)
    assert not span.is_recording() and tail_trace_id_of(span) is None and TAIL_KEY not in tr.carrier(span)


def test_a_callers_sampled_0_is_respected_unless_overridden():
    parent = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-00"}
    for overrides, recorded in ((False, False), (True, True)):
        tr = Tracing("main", ratio=1.0, tail=True, tail_overrides_parent=overrides)
        span = tr.start("POST", tr.extract_headers(parent), kind=SpanKind.SERVER)
        assert span.is_recording() is recorded
        assert span.get_span_context().trace_id == int("ab" * 16, 16)  # the caller's trace either way


def test_the_engine_records_only_carriers_marked_for_the_tail():
    records: list[SpanRecord] = []
    front = Tracing("main", ratio=0.0, tail=True)
    engine = Tracing("scheduler", ratio=0.0, tail=True, sink=records.append)
    carrier = front.carrier(front.start("POST", None))
    engine.record("queue", engine.extract(carrier), 1, 2)
    assert [(r.name, r.sampled, r.role) for r in records] == [("queue", False, "scheduler")]
    unmarked = {k: v for k, v in carrier.items() if k != TAIL_KEY}
    assert engine.extract(unmarked) is None  # an unsampled request nobody records
    assert Tracing("scheduler", ratio=0.0, tail=False).extract(carrier) is None


def test_records_wait_for_the_decision_and_late_ones_follow_it():
    tail, exp, counts = sampler()
    tail.add(record("a" * 32, "1" * 16, role="scheduler", pid=7, attributes={"sightline.dp_rank": 1}))
    tail.add(record("b" * 32, "2" * 16))
    tail.add(record("c" * 32, "3" * 16, sampled=True))  # head-sampled: exported by its own process
    assert exp.get_finished_spans() == () and set(tail.pending) == {"a" * 32, "b" * 32}
    tail.decide("a" * 32, "error")
    tail.decide("b" * 32, None)
    tail.add(
        record(
            "a" * 32,
            "4" * 16,
            role="main",
            kind="SERVER",
            parent_span_id=None,
            status="ERROR",
            status_message="boom",
            link_ids=[f"{'e' * 32}-{'f' * 16}"],
        )
    )
    tail.add(record("b" * 32, "5" * 16))  # dropped: late spans too
    spans = exp.get_finished_spans()
    assert [s.name for s in spans] == ["s", "s"] and not tail.pending
    first, late = spans
    assert first.resource.attributes["sightline.process.role"] == "scheduler"
    assert first.resource.attributes["sightline.dp_rank"] == 1 and "sightline.dp_rank" not in first.attributes
    assert first.context.trace_flags.sampled and f"{first.context.trace_id:032x}" == "a" * 32
    assert late.kind is SpanKind.SERVER and late.status.description == "boom"
    assert f"{late.links[0].context.span_id:016x}" == "f" * 16
    assert counts == [("kept", "error"), ("dropped", "not_selected")]


def test_the_buffer_is_bounded_and_counts_what_it_evicts():
    tail, exp, counts = sampler(max_traces=2)
    for i in range(3):
        tail.add(record(f"{i:032x}", "1" * 16))
    assert list(tail.pending) == [f"{1:032x}", f"{2:032x}"] and counts == [("dropped", "buffer_full")]
    tail.decide(f"{0:032x}", "error")  # decided after eviction: nothing left to export
    assert exp.get_finished_spans() == ()


def test_the_outbox_carries_a_workers_decisions():
    tail, _, _ = sampler()
    tail.outbox = ([], [])
    tail.decide("a" * 32, "shed")
    tail.decide("b" * 32, None)
    assert tail.take_outbox() == (["a" * 32], ["b" * 32]) and tail.take_outbox() == ([], [])


def test_the_policy_keeps_failures_and_slow_requests():
    policy = TailPolicy(ttft_s=1.0, tpot_s=0.1)
    assert policy.keep_reason(outcomes.STOP, 0.5, 0.05) is None
    assert policy.keep_reason(outcomes.LENGTH, 1.5, 0.05) == "ttft"
    assert policy.keep_reason(outcomes.LENGTH, 0.5, 0.2) == "tpot"
    assert policy.keep_reason(outcomes.REJECTED, None, None) is None
    assert [policy.keep_reason(o, None, None) for o in (outcomes.SHED, outcomes.TIMEOUT, outcomes.ENGINE_FAILURE)] == [
        "shed",
        "aborted",
        "error",
    ]
    assert slo_policy(None, None) == TailPolicy(1.0, 0.1)  # dashboards/slo.yaml's thresholds
    assert slo_policy(0, 250) == TailPolicy(None, 0.25)


def test_every_ending_maps_to_one_outcome():
    assert outcomes.finished_outcome("abort", "operator") == outcomes.ABORTED_BY_OPERATOR
    assert outcomes.finished_outcome("abort", "internal_error") == outcomes.ERROR
    assert outcomes.finished_outcome("error", None) == outcomes.ERROR
    assert outcomes.refused_outcome(503, "shutting_down") == outcomes.SHUTDOWN
    assert outcomes.refused_outcome(503, "engine_unavailable") == outcomes.UNAVAILABLE
    assert outcomes.refused_outcome(408, "body_timeout") == outcomes.REJECTED
    assert outcomes.refused_outcome(500, "internal") == outcomes.ERROR
