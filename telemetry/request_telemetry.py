"""Per-request telemetry in the main process: the HTTP server span and its main-process
children, every per-request histogram (with trace-id exemplars), the request counters,
the latency breakdown returned to the client, the request log line and the timeline.

The TokenizerManager calls `tokenized`, `producer`, `on_output` and `finish`; the HTTP
layer calls `begin`, `rejected` and `end`.  They read the request's own state (`TracedRequest`:
the front end's `ReqState`) and write its `RequestTrace` and latency breakdown; which HTTP status it ends
with is decided by the front end, not here.  All intervals come from the monotonic stamps the
messages carry (`protocol.io_struct.Stamps`); their exact definitions are in
docs/metrics.md.
"""

from __future__ import annotations

from typing import Any, Protocol

from opentelemetry.trace import Span, SpanKind, set_span_in_context
from prometheus_client import Counter, Histogram

from protocol.io_struct import BatchStrOutput, ReqMeta, SpecCounts, Stamps, StrOut
from protocol.reasons import AbortReason
from telemetry.clock import now_ns
from telemetry.downstream_gaps import DownstreamGaps
from telemetry.embedding_telemetry import finish_embedding
from telemetry.flight_recorder import FlightRecorder
from telemetry.logs import log_request
from telemetry.loop_lag import LoopLagMonitor
from telemetry.metrics import Metrics
from telemetry.outcomes import ENGINE_FAILURE, LENGTH, STOP, error_type_of, finished_outcome, refused_outcome
from telemetry.request_slo import ALL, Objectives, judge
from telemetry.request_trace import RequestTrace
from telemetry.tail_sampling import TailPolicy, TailSampler
from telemetry.tenant_usage import TenantUsage
from telemetry.timeline import Timeline
from telemetry.tracing import (
    PRODUCER_KEY,
    Tracing,
    hop_attributes,
    set_error,
    span_error,
    tail_trace_id_of,
    trace_id_of,
    traceparent_of,
)

PROVIDER = "sightline"


def queue_seconds(st: Stamps) -> float | None:
    """Time in the Scheduler's queue over every waiting interval: from `sched_recv` to its first admission, plus
    each wait after a retraction (`waited`, the Scheduler's sum); None when it never ran."""
    if st.waited is not None:
        return st.waited / 1e9
    if st.sched_recv is not None and st.scheduled is not None:
        return (st.scheduled - st.sched_recv) / 1e9
    return None


SERVER_TIMING = (
    ("queue", "queue_ms"),
    ("prefill", "prefill_ms"),
    ("decode", "decode_ms"),
    ("tokenize", "tokenize_ms"),
    ("total", "e2e_ms"),
)


def server_timing(breakdown: dict) -> str:
    """The `Server-Timing` header of a finished request (W3C Server Timing; durations in ms) from its breakdown:
    queue (every wait), prefill, decode, tokenize and total (arrival → the TokenizerManager's finish)."""
    return ", ".join(
        f"{name};dur={breakdown[key]:.3f}" for name, key in SERVER_TIMING if breakdown.get(key) is not None
    )


class TracedRequest(Protocol):
    """What telemetry reads and writes on a request (the front end's `ReqState`)."""

    route: str
    operation: str
    arrival: int
    stream: bool
    rid: str
    prompt_tokens: int
    cached_tokens: int
    retractions: int  # times the engine took it out of the batch and resumed it
    speculative: SpecCounts | None  # speculated: draft tokens proposed and accepted, and its token steps
    tenant: str  # the tenant its API key names
    slo: Objectives | None  # its latency objectives (telemetry.request_slo), judged at its end
    cpu_ns: int  # its share of the engine steps' CPU time
    meta: ReqMeta
    status: int
    breakdown: dict | None
    completion_tokens: int
    tool_call_failure: tuple[str, str] | None  # (parser, text) of an answer whose tool calls did not parse
    trace: RequestTrace  # what telemetry keeps of it: span, trace ids, receive stamps, outcome, recorder input


def speculative_numbers(c: SpecCounts) -> dict[str, int]:
    """A speculated request's draft tokens proposed, accepted and rejected, and the engine steps that gave it
    tokens: its breakdown's `speculative` and its span's `sightline.speculative.*`."""
    return {"proposed": c.proposed, "accepted": c.accepted, "rejected": c.proposed - c.accepted, "steps": c.steps}


def vllm_latencies(st: Stamps) -> dict[str, float]:
    """The engine intervals under the span attribute names vLLM gives them (seconds): prefill is admission →
    first token, decode first token → finished, inference the two together."""
    out = {}
    for name, a, b in (
        ("time_in_model_prefill", st.scheduled, st.first_token),
        ("time_in_model_decode", st.first_token, st.finished),
        ("time_in_model_inference", st.scheduled, st.finished),
    ):
        if a is not None and b is not None:
            out[f"gen_ai.latency.{name}"] = (b - a) / 1e9
    return out


def _ms(start: int | None, end: int | None) -> float | None:
    return None if start is None or end is None else round((end - start) / 1e6, 3)


class RequestTelemetry:
    def __init__(
        self,
        tracing: Tracing,
        metrics: Metrics | None,
        timeline: Timeline,
        model_name: str,
        log_requests: bool,
        loop_lag: LoopLagMonitor | None = None,
    ) -> None:
        self.tracing = tracing
        self.m = metrics  # None with --no-enable-metrics
        self.timeline = timeline
        self.model = model_name
        self.log_requests = log_requests
        self.genai = None  # a telemetry.genai_metrics.GenAIMetrics when OTLP GenAI metrics are exported
        self.otlp_mirror = None  # a telemetry.otlp_catalogue.HistogramMirror with --otel-metrics-catalogue
        self.loop_lag = loop_lag  # this process's event-loop monitor: stalls during a request go on its span
        self.tail: TailSampler | None = None  # tail sampling: every span of this front end and of the engine
        self.tail_policy = TailPolicy()
        self.recorder: FlightRecorder | None = None  # --dump-requests: one record per request, at its end
        self.tenants = TenantUsage(metrics)  # per-tenant counters, their label bounded
        self.gaps: DownstreamGaps | None = DownstreamGaps(wall=tracing.wall)  # gaps after the Scheduler

    def tenants_from(self, tenants: list[str], cap: int) -> None:
        """The tenants the keys name (at start and after each reload): the per-tenant label's values."""
        self.tenants.set_tenants(tenants or ["default"], cap)

    def shutdown(self) -> None:
        """Export what is left: spans, kept traces, OTLP metrics, request records."""
        self.tracing.shutdown()
        if self.recorder is not None:
            self.recorder.close()
        if self.tail is not None:
            self.tail.shutdown()
        if self.genai is not None:
            self.genai.shutdown()

    def observe(
        self, metric: Histogram | None, value: float | None, rt: TracedRequest | None = None, *labels: str
    ) -> None:
        """One observation (labels default to the model and the request's route), a kept trace's exemplar
        attached; a no-op without metrics.  Public: the per-operation helpers (telemetry.embedding_telemetry)
        record through it."""
        if metric is None or value is None:
            return
        labels = labels or (self.model, rt.route)
        metric.labels(*labels).observe(max(value, 0.0), exemplar=rt.trace.exemplar() if rt else None)
        if self.otlp_mirror is not None:
            self.otlp_mirror.observe(metric, labels, max(value, 0.0))

    def count(self, metric: Counter | None, *labels: str, amount: float = 1.0) -> None:
        """Add `amount` to a counter; a no-op without metrics."""
        if metric is not None:
            metric.labels(*labels).inc(amount)

    # -- HTTP side ------------------------------------------------------------------
    def begin(self, rt: TracedRequest, headers, method: str, attributes: dict[str, Any]) -> None:
        """Open the request's HTTP server span (a child of the client's traceparent, if any)."""
        parent = self.tracing.extract_headers(headers)
        span = self.tracing.start(
            f"{method} {rt.route}",
            parent,
            kind=SpanKind.SERVER,
            start_mono=rt.arrival,
            attributes={
                "http.request.method": method,
                "http.route": rt.route,
                "url.path": rt.route,
                "gen_ai.operation.name": rt.operation,
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.request.model": self.model,
                **attributes,
            },
        )
        rt.trace.span, rt.trace.trace_id, rt.trace.tail_id = span, trace_id_of(span), tail_trace_id_of(span)
        rt.trace.ctx = set_span_in_context(span) if span.is_recording() else None

    def begin_choice(self, parent: TracedRequest, child: TracedRequest, index: int) -> None:
        """One choice of a request with several (`n`, a list of prompts): its own span under the HTTP span, in
        the same trace; the parent decides tail sampling for the whole trace (`end_choices`)."""
        child.trace.choice_of = parent.rid or "http"
        child.slo = parent.slo  # each choice is judged against the request's objectives
        if parent.trace.span is None or parent.trace.ctx is None:
            return
        span = self.tracing.start(
            "choice", parent.trace.ctx, start_mono=child.arrival, attributes={"sightline.choice.index": index}
        )
        child.trace.span, child.trace.trace_id, child.trace.tail_id = span, parent.trace.trace_id, parent.trace.tail_id
        child.trace.ctx = set_span_in_context(span)

    def close_choices(self, children: list[TracedRequest]) -> None:
        for c in children:
            if c.trace.span is not None and not c.trace.ended:
                c.trace.ended = True
                c.trace.span.end(end_time=self.tracing.wall(now_ns()))

    def end_choices(self, parent: TracedRequest, children: list[TracedRequest], status: int) -> None:
        """A request with several choices has answered: its children's rids on its span, the tail-sampling
        decision from the worst of them (an error or abort in any one keeps the trace), the HTTP span closed."""
        self.close_choices(children)
        if parent.trace.span is not None:
            parent.trace.span.set_attribute("sightline.choice_rids", [c.rid for c in children if c.rid])
        worst = next(
            (c for c in children if c.trace.outcome not in (None, STOP, LENGTH)), children[0] if children else None
        )
        if worst is not None and self.tail is not None and parent.trace.tail_id is not None:
            ttft = min(((c.trace.first_recv - c.arrival) / 1e9 for c in children if c.trace.first_recv), default=None)
            missed = any((c.breakdown or {}).get("slo", {}).get(ALL) is False for c in children)
            self.tail_decide(parent, worst.trace.outcome or STOP, ttft, None, missed)
            for c in children:
                c.trace.trace_id = parent.trace.trace_id
        self.end(parent, status)

    def response_headers(self, rt: TracedRequest) -> dict[str, str]:
        tp = traceparent_of(rt.trace.span) if rt.trace.trace_id or rt.trace.tail_id else None
        return {"traceparent": tp} if tp else {}

    def shed(self, reason: str) -> None:
        self.count(self.m and self.m.shed, self.model, reason)

    def rejected(self, rt: TracedRequest, status: int, error_type: str, message: str, client_gone: bool) -> None:
        """A request refused before reaching the engine (400, 503...), or whose client left
        before it was read (`client_gone`: a client abort, like one that leaves mid-generation)."""
        outcome = refused_outcome(status, error_type)
        self.count(self.m and self.m.requests, self.model, "abort" if client_gone else "error", str(status), outcome)
        self.tenants.request(rt.tenant, outcome)
        met = self.judge_slo(rt, outcome, None, None, (now_ns() - rt.arrival) / 1e9)
        self.tail_decide(rt, outcome, None, None, met.get(ALL) is False)
        if client_gone:
            self.count(self.m and self.m.aborts, self.model, AbortReason.CLIENT_DISCONNECT)
        if rt.trace.span is not None:
            set_error(rt.trace.span, error_type, message)
        if self.genai is not None:
            self.genai.record(
                rt.operation, (now_ns() - rt.arrival) / 1e9, input_tokens=rt.prompt_tokens, error_type=error_type
            )
        self.end(rt, status)
        if self.recorder is not None:
            self.recorder.record(rt, outcome, "abort" if client_gone else "error", status)

    def end(self, rt: TracedRequest, status: int | None = None) -> None:
        """The HTTP response is complete (or the client is gone): close the server span."""
        if rt.trace.ended or rt.trace.span is None:
            return
        rt.trace.ended = True
        end = now_ns()
        if rt.stream and rt.trace.first_recv is not None:
            self.tracing.record(
                "stream",
                rt.trace.ctx,
                rt.trace.first_recv,
                end,
                attributes={"sightline.rid": rt.rid, "gen_ai.usage.output_tokens": rt.completion_tokens},
            )
        rt.trace.span.set_attribute("http.response.status_code", status or rt.status)
        rt.trace.span.end(end_time=self.tracing.wall(end))

    # -- TokenizerManager side ---------------------------------------------------------
    def tool_call_parse_failed(self, rt: TracedRequest, parser: str, text: str) -> None:
        """An answer started like a tool call and did not parse (it goes back as content): counted, named on
        the span, and kept for the flight recorder (which writes the text only with --dump-content)."""
        self.count(self.m and self.m.tool_parse_failures, parser)
        rt.tool_call_failure = (parser, text)
        if rt.trace.span is not None:
            rt.trace.span.set_attribute("sightline.tool_call_parse_failed", parser)

    def tokenized(self, rt: TracedRequest, start: int, end: int) -> None:
        rt.trace.tokenize_ns = end - start
        if rt.trace.span is not None:
            rt.trace.span.set_attributes(
                {"sightline.rid": rt.rid, "gen_ai.response.id": rt.rid, "gen_ai.usage.input_tokens": rt.prompt_tokens}
            )
        self.tracing.record(
            "tokenize",
            rt.trace.ctx,
            start,
            end,
            attributes={"sightline.rid": rt.rid, "gen_ai.usage.input_tokens": rt.prompt_tokens},
        )

    def producer(self, rt: TracedRequest) -> tuple[dict[str, str], Span | None]:
        """The carrier for the request message, and the PRODUCER span around its send."""
        carrier = self.tracing.carrier(rt.trace.span) if rt.trace.trace_id or rt.trace.tail_id else {}
        if not carrier:
            return carrier, None
        span = self.tracing.start(
            "send scheduler",
            rt.trace.ctx,
            kind=SpanKind.PRODUCER,
            attributes={"sightline.rid": rt.rid, **hop_attributes("scheduler", "TokenizedGenerateReqInput", "send")},
        )
        carrier[PRODUCER_KEY] = traceparent_of(span) or ""
        return carrier, span

    def on_stats(self, msg, recv: int | None) -> None:
        """A child's stats message: its hop latency (Scheduler's) and its finished spans."""
        if recv is not None:
            self.observe(self.m and self.m.ipc_hop, (recv - msg.sent_at) / 1e9, None, "scheduler_stats")
        for rec in msg.spans:
            self.timeline.add_span(rec)
            if self.tail is not None:
                self.tail.add(rec)

    def on_batch(self, batch: BatchStrOutput, recv: int) -> None:
        if batch.outputs:
            hop = self.m and self.m.ipc_hop
            self.observe(hop, (recv - batch.sent_at) / 1e9, None, "detokenizer_to_tm")
            st = batch.outputs[0].meta.stamps
            if st.detok_recv and st.sched_sent:
                self.observe(hop, (st.detok_recv - st.sched_sent) / 1e9, None, "scheduler_to_detokenizer")

    def on_output(self, rt: TracedRequest, out: StrOut, recv: int) -> None:
        """One output of the request (its `meta` is already the request's latest)."""
        if self.recorder is not None:
            self.recorder.on_output(rt, out.text)
        st = out.meta.stamps
        if st.detok_recv and st.detok_done:
            rt.trace.detok_busy_ns += st.detok_done - st.detok_recv
        n = len(out.output_ids)
        if n == 0:
            return
        m = self.m
        if rt.trace.first_recv is None:
            rt.trace.first_recv = recv
            self.observe(m and m.ttft, (recv - rt.arrival) / 1e9, rt)
            if st.sched_recv and st.tokenized:
                self.observe(m and m.ipc_hop, (st.sched_recv - st.tokenized) / 1e9, None, "tm_to_scheduler")
            self.tracing.record(
                "receive tokenizer_manager",
                rt.trace.ctx,
                recv,
                now_ns(),
                kind=SpanKind.CONSUMER,
                links=self.tracing.link_of(out.meta.trace),
                attributes={
                    "sightline.rid": rt.rid,
                    **hop_attributes("tokenizer_manager", "BatchStrOutput", "process"),
                },
            )
        elif rt.trace.last_recv is not None:
            gap = (recv - rt.trace.last_recv) / 1e9 / n
            for _ in range(n):
                self.observe(m and m.itl, gap, rt)
            if self.gaps is not None:
                self.gaps.output(rt, st, recv)
        rt.trace.last_recv = recv

    def finish(self, rt: TracedRequest, finish_reason: str, abort_reason: str | None, error: str | None) -> dict:
        """The request ended in the TM (its `status` already decided): observe everything once;
        returns the breakdown."""
        if rt.operation == "embeddings":  # its own families (telemetry.embedding_telemetry)
            return finish_embedding(self, rt, finish_reason, abort_reason, error, queue_seconds(rt.meta.stamps))
        end, m = now_ns(), self.m
        st = rt.meta.stamps
        completion_tokens = rt.completion_tokens
        ttft = (rt.trace.first_recv - rt.arrival) / 1e9 if rt.trace.first_recv else None
        e2e = (end - rt.arrival) / 1e9
        tpot = (e2e - ttft) / (completion_tokens - 1) if ttft is not None and completion_tokens >= 2 else None
        outcome = rt.trace.outcome = finished_outcome(finish_reason, abort_reason)
        met = self.judge_slo(rt, outcome, ttft, tpot, e2e)
        self.tail_decide(rt, outcome, ttft, tpot, met.get(ALL) is False)  # first: a kept trace is the exemplar
        self.observe(m and m.e2e, e2e, rt)
        self.observe(m and m.tpot, tpot, rt)
        queue = queue_seconds(st)
        if queue is not None:
            self.observe(m and m.queue_time, queue, rt)
        waits = st.wait_reasons or {}
        for reason, ns in waits.items():
            self.observe(m and m.wait_time, ns / 1e9, rt, self.model, rt.route, reason)
        for metric, a, b in (
            (m and m.prefill_time, st.scheduled, st.first_token),
            (m and m.decode_time, st.first_token, st.finished),
        ):
            if a is not None and b is not None:
                self.observe(metric, (b - a) / 1e9, rt)
        self.observe(m and m.tokenize_time, rt.trace.tokenize_ns / 1e9, rt)
        if rt.trace.detok_busy_ns:
            self.observe(m and m.detokenize_time, rt.trace.detok_busy_ns / 1e9, rt)
        self.observe(m and m.prompt_tokens, rt.prompt_tokens, rt)
        self.observe(m and m.generation_tokens, completion_tokens, rt)
        self.count(m and m.requests, self.model, finish_reason, str(rt.status), outcome)
        self.count(m and m.prompt_tokens_total, self.model, amount=rt.prompt_tokens)
        self.count(m and m.generation_tokens_total, self.model, amount=completion_tokens)
        self.tenants.request(rt.tenant, outcome)
        self.tenants.usage(rt.tenant, rt.prompt_tokens, rt.cached_tokens, completion_tokens, rt.cpu_ns)
        if abort_reason:
            self.count(m and m.aborts, self.model, abort_reason)
            if abort_reason == ENGINE_FAILURE and self.gaps is not None:
                self.gaps.cut(rt, end)
        rt.breakdown = {
            "ttft_ms": _ms(rt.arrival, rt.trace.first_recv),
            "queue_ms": round(queue * 1e3, 3) if queue is not None else None,
            "retractions": rt.retractions,
            "wait_ms": {reason: round(ns / 1e6, 3) for reason, ns in waits.items()},
            "prefill_ms": _ms(st.scheduled, st.first_token),
            "decode_ms": _ms(st.first_token, st.finished),
            "tokenize_ms": round(rt.trace.tokenize_ns / 1e6, 3),
            "detokenize_ms": round(rt.trace.detok_busy_ns / 1e6, 3),
            "e2e_ms": _ms(rt.arrival, end),
            "cached_tokens": rt.cached_tokens,
        }
        if rt.speculative is not None:
            rt.breakdown["speculative"] = speculative_numbers(rt.speculative)
        if met:
            rt.breakdown["slo"] = met
        if rt.trace.trace_id:
            rt.breakdown["trace_id"] = rt.trace.trace_id
        if self.genai is not None:  # error.type as on the span
            self.genai.record(
                rt.operation,
                e2e,
                ttft=ttft,
                input_tokens=rt.prompt_tokens,
                output_tokens=completion_tokens,
                cached_tokens=rt.cached_tokens,
                error_type=error_type_of(finish_reason, abort_reason),
            )
        self._annotate_span(rt, finish_reason, completion_tokens, abort_reason, error, ttft, st, e2e)
        summary = {
            "rid": rt.rid,
            "route": rt.route,
            "tenant": rt.tenant,
            "finish_reason": finish_reason,
            "status": rt.status,
            "prompt_tokens": rt.prompt_tokens,
            "completion_tokens": completion_tokens,
            **rt.breakdown,
        }
        if abort_reason:
            summary["abort_reason"] = abort_reason
        sources = getattr(rt, "param_sources", None)  # request | generation_config | default, per sampling field
        self.timeline.finish(
            rt.trace.trace_id or rt.trace.tail_id or f"rid:{rt.rid}",
            {**summary, "param_sources": sources} if sources else summary,
        )
        if self.log_requests:
            log_request(
                {
                    **summary,
                    "trace_id": rt.trace.trace_id,
                    "span_id": f"{rt.trace.span.get_span_context().span_id:016x}" if rt.trace.trace_id else None,
                }
            )
        if self.recorder is not None:
            self.recorder.record(rt, outcome, finish_reason, rt.status)
        return rt.breakdown

    def judge_slo(
        self, rt: TracedRequest, outcome: str, ttft: float | None, tpot: float | None, e2e: float
    ) -> dict[str, bool]:
        """The request's objectives, judged and counted per tenant; the missed ones named on its span."""
        met = judge(rt.slo, outcome, ttft, tpot, e2e) if rt.slo else {}
        if met:
            self.tenants.slo(rt.tenant, met)
            missed = [k for k, ok in met.items() if not ok and k != ALL]
            if missed and rt.trace.span is not None:
                rt.trace.span.set_attribute("sightline.slo.missed", missed)
        return met

    def tail_decide(
        self, rt: TracedRequest, outcome: str, ttft: float | None, tpot: float | None, missed_slo: bool = False
    ) -> None:
        """Tail sampling: the request ended; export its whole trace if it went wrong, else drop it."""
        if self.tail is None or rt.trace.tail_id is None or rt.trace.choice_of:
            return
        reason = self.tail_policy.keep_reason(outcome, ttft, tpot, missed_slo)
        self.tail.decide(rt.trace.tail_id, reason)
        if reason is not None:
            rt.trace.trace_id = rt.trace.tail_id  # exported: exemplars, the breakdown and the log line name it
            if rt.trace.span is not None:
                rt.trace.span.set_attribute("sightline.tail_sampling.reason", reason)

    def _annotate_span(self, rt, finish_reason, completion_tokens, abort_reason, error, ttft, st, e2e) -> None:
        if rt.trace.span is None or not (rt.trace.trace_id or rt.trace.tail_id):
            return
        attrs = {
            "gen_ai.response.finish_reasons": [finish_reason],
            "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": rt.cached_tokens,
            "gen_ai.latency.e2e": e2e,
        }
        if ttft is not None:
            attrs["sightline.ttft_seconds"] = attrs["gen_ai.latency.time_to_first_token"] = ttft
            if rt.stream:  # the GenAI conventions' attribute of a streamed response
                attrs["gen_ai.response.time_to_first_chunk"] = ttft
        queue = queue_seconds(st)
        if queue is not None:
            attrs["sightline.queue_seconds"] = attrs["gen_ai.latency.time_in_queue"] = queue
        for reason, ns in (st.wait_reasons or {}).items():
            attrs[f"sightline.wait.{reason}_seconds"] = ns / 1e9
        attrs.update(vllm_latencies(st))
        if rt.retractions:
            attrs["sightline.retractions"] = rt.retractions
        if rt.speculative is not None:
            attrs.update({f"sightline.speculative.{k}": v for k, v in speculative_numbers(rt.speculative).items()})
        stall = self.loop_lag.worst_between(rt.arrival, now_ns()) if self.loop_lag is not None else None
        if stall is not None:  # the event loop stalled longer than the monitor's `slow` while this request ran
            attrs["sightline.event_loop.lag_max_seconds"] = stall
        rt.trace.span.set_attributes(attrs)
        span_error(rt.trace.span, finish_reason, abort_reason, error)
