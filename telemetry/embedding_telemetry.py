"""The end of an embeddings request in the main process (`RequestTelemetry.finish` hands it here).

Its latencies and sizes go to their own families, labelled by route (/v1/embeddings, /encode, and the
rerank and score routes, which embed their texts as one embeddings request) and kind
(`sightline_embedding_request_latency_seconds{kind=e2e|queue|prefill|tokenize}`,
`sightline_embedding_request_size{kind=inputs|tokens}`): the generation histograms (TTFT,
TPOT, e2e...) keep meaning what they say.  It is counted like every request: one
`sightline_requests_total` sample (finish reason, status, outcome), the prompt-token counter,
the tenant's counters, the flight recorder, the timeline and the request log line; its
server span gets the usage and latency attributes.
"""

from __future__ import annotations

from typing import Any

from telemetry.clock import now_ns
from telemetry.logs import log_request
from telemetry.outcomes import error_type_of, finished_outcome
from telemetry.tracing import span_error


def _ms(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else round((b - a) / 1e6, 3)


def finish_embedding(
    tel: Any, rt: Any, finish_reason: str, abort_reason: str | None, error: str | None, queue: float | None
) -> dict:
    """`tel`: the RequestTelemetry, `rt`: the request (its TracedRequest), `queue`: its queue seconds."""
    end, m, model = now_ns(), tel.m, tel.model
    st = rt.meta.stamps
    e2e = (end - rt.arrival) / 1e9
    outcome = finished_outcome(finish_reason, abort_reason)
    tel.tail_decide(rt, outcome, None, None)
    prefill = (st.finished - st.scheduled) / 1e9 if st.finished is not None and st.scheduled is not None else None
    lat = m and m.embed_latency
    for kind, value in (("e2e", e2e), ("queue", queue), ("prefill", prefill), ("tokenize", rt.trace.tokenize_ns / 1e9)):
        tel.observe(lat, value, rt, model, rt.route, kind)
    inputs: int = getattr(rt, "embed_inputs", 0)
    if inputs:
        tel.observe(m and m.embed_size, inputs, rt, model, rt.route, "inputs")
        tel.observe(m and m.embed_size, rt.prompt_tokens, rt, model, rt.route, "tokens")
    tel.count(m and m.requests, model, finish_reason, str(rt.status), outcome)
    tel.count(m and m.prompt_tokens_total, model, amount=rt.prompt_tokens)
    tel.tenants.request(rt.tenant, outcome)
    tel.tenants.usage(rt.tenant, rt.prompt_tokens, rt.cached_tokens, 0, rt.cpu_ns)
    if abort_reason:
        tel.count(m and m.aborts, model, abort_reason)
    rt.breakdown = {
        "queue_ms": round(queue * 1e3, 3) if queue is not None else None,
        "wait_ms": {reason: round(ns / 1e6, 3) for reason, ns in (st.wait_reasons or {}).items()},
        "prefill_ms": _ms(st.scheduled, st.finished),
        "tokenize_ms": round(rt.trace.tokenize_ns / 1e6, 3),
        "e2e_ms": _ms(rt.arrival, end),
        "cached_tokens": rt.cached_tokens,
        "inputs": inputs,
    }
    if rt.trace.trace_id:
        rt.breakdown["trace_id"] = rt.trace.trace_id
    if tel.genai is not None:
        tel.genai.record(
            rt.operation, e2e, input_tokens=rt.prompt_tokens, error_type=error_type_of(finish_reason, abort_reason)
        )
    _annotate(rt, finish_reason, abort_reason, error, e2e, queue)
    summary: dict[str, Any] = {
        "rid": rt.rid,
        "route": rt.route,
        "tenant": rt.tenant,
        "finish_reason": finish_reason,
        "status": rt.status,
        "prompt_tokens": rt.prompt_tokens,
        "completion_tokens": 0,
        **rt.breakdown,
    }
    if abort_reason:
        summary["abort_reason"] = abort_reason
    tel.timeline.finish(rt.trace.trace_id or rt.trace.tail_id or f"rid:{rt.rid}", summary)
    if tel.log_requests:
        log_request(
            {
                **summary,
                "trace_id": rt.trace.trace_id,
                "span_id": f"{rt.trace.span.get_span_context().span_id:016x}" if rt.trace.trace_id else None,
            }
        )
    if tel.recorder is not None:
        tel.recorder.record(rt, outcome, finish_reason, rt.status)
    return rt.breakdown


def _annotate(
    rt: Any, finish_reason: str, abort_reason: str | None, error: str | None, e2e: float, queue: float | None
) -> None:
    if rt.trace.span is None or not (rt.trace.trace_id or rt.trace.tail_id):
        return
    attrs = {
        "gen_ai.response.finish_reasons": [finish_reason],
        "gen_ai.usage.input_tokens": rt.prompt_tokens,
        "gen_ai.usage.cache_read.input_tokens": rt.cached_tokens,
        "gen_ai.latency.e2e": e2e,
        "sightline.embedding.inputs": getattr(rt, "embed_inputs", 0),
    }
    if queue is not None:
        attrs["sightline.queue_seconds"] = attrs["gen_ai.latency.time_in_queue"] = queue
    rt.trace.span.set_attributes(attrs)
    span_error(rt.trace.span, finish_reason, abort_reason, error)
