"""The Scheduler's stage spans from a real engine run: one `queue` span per waiting interval, and each one
after a retraction opens with a `retracted` event saying what the request had and what the cache kept."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protocol.io_struct import ReqMeta
from protocol.sampling_params import SamplingParams
from telemetry.engine_spans import SchedulerSpans
from telemetry.tracing import Tracing
from tests.helpers import make_core


def test_a_retracted_request_has_a_queue_span_per_wait_and_a_retracted_event(tiny):
    tr = Tracing("scheduler", sink=lambda r: None)
    exp = InMemorySpanExporter()
    tr.provider.add_span_processor(SimpleSpanProcessor(exp))
    spans = SchedulerSpans(tr)
    core = make_core(tiny, max_total_tokens=120)
    reqs = []
    for i in range(4):
        req = core.add_request(
            f"r{i}", [5 + i] * 10, SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)
        )
        root = tr.start("POST /generate", None)
        spans.received(req.rid, ReqMeta(trace=tr.carrier(root)), 0, 0)
        reqs.append(req)
    core.run_to_completion()
    assert core.retractions
    for req in reqs:
        spans.finished(req, req.finish_reason.value)
    by_rid: dict[str, list] = {}
    for s in exp.get_finished_spans():
        if s.name == "queue":
            by_rid.setdefault(s.attributes["sightline.rid"], []).append(s)
    for req in reqs:
        queues = sorted(by_rid[req.rid], key=lambda s: s.attributes["sightline.queue.after_retractions"])
        assert len(queues) == 1 + req.num_retractions
        assert not [e for e in queues[0].events if e.name == "retracted"]
        for span, r in zip(queues[1:], req.times.retractions):
            (event,) = [e for e in span.events if e.name == "retracted"]
            reasons = [e.attributes["sightline.wait.reason"] for e in span.events if e.name == "wait_reason"]
            assert reasons[0] == "retracted"  # why it waited, from the retraction on
            assert [e.name for e in span.events][-1] == "resumed"
            assert event.name == "retracted" and event.attributes["sightline.retraction.reason"] == "kv_exhausted"
            assert event.attributes["sightline.retraction.computed_tokens"] == r.computed
            assert event.attributes["sightline.retraction.discarded_tokens"] == r.computed - r.cached == 0
        assert [e.name for e in queues[0].events][-1] == "admitted"


def test_prefill_span_says_how_many_prompt_tokens_were_scored_and_cached(tiny):
    tr = Tracing("scheduler", sink=lambda r: None)
    exp = InMemorySpanExporter()
    tr.provider.add_span_processor(SimpleSpanProcessor(exp))
    spans = SchedulerSpans(tr)
    core = make_core(tiny)
    prompt = list(range(10, 30))
    for rid, lp in (("plain", None), ("scored", 2)):
        req = core.add_request(rid, prompt, SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=lp))
        spans.received(rid, ReqMeta(trace=tr.carrier(tr.start("POST /generate", None))), 0, 0)
        core.run_to_completion()
        spans.finished(req, req.finish_reason.value)
    prefill = {s.attributes["sightline.rid"]: s.attributes for s in exp.get_finished_spans() if s.name == "prefill"}
    assert "sightline.prompt_tokens_scored" not in prefill["plain"]
    assert prefill["plain"]["gen_ai.usage.cache_read.input_tokens"] == 0
    assert prefill["scored"]["sightline.prompt_tokens_scored"] == 19  # every prompt token but the first
    assert prefill["scored"]["sightline.prompt_tokens_cached"] == 19  # held by the cache, computed again
    assert prefill["scored"]["gen_ai.usage.cache_read.input_tokens"] == 0
