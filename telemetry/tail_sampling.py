"""Tail-based trace sampling inside the server: keep the traces of the requests that went wrong.

Head sampling (`--otel-sampling-ratio`) decides at a request's arrival and exports those
traces from every process as before.  With tail sampling on, every other request is
recorded too (spans built, not exported: the SDK's RECORD_ONLY), its spans from every
process reach the front end as `SpanRecord`s (the children forward them in their stats
messages), and the request's end decides: a request that errored, was aborted or shed, or
breached the TTFT/TPOT thresholds or missed one of its own latency objectives
(telemetry/request_slo.py) is exported whole (`keep_reason`); the rest are dropped.

`TailSampler` holds the undecided traces (bounded: the oldest goes first, counted as
`buffer_full`), remembers recent decisions so spans that arrive after the decision (the
children's, the server span that ends after the response) follow it, and exports a kept
trace's records as OTLP spans with each origin process's resource, so the backend sees
them as if each process had exported them itself.

Unlike a collector's tail sampling, the decision uses what only the engine knows (queue
wait, TTFT and TPOT as measured at the source, abort causes, shed reason), needs no
collector that holds every span of every trace, and costs no export for the traces dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from protocol.io_struct import SpanRecord
from telemetry import outcomes
from telemetry.genai_instruments import SCHEMA_URL
from telemetry.slo_spec import slo_spec_goodput

log = logging.getLogger("sightline.tracing")
KEEP_REASONS = ("error", "aborted", "shed", "slo", "ttft", "tpot")
DROP_REASONS = ("not_selected", "buffer_full")
MAX_SPANS_PER_TRACE = 2000
_WHERE = ("sightline.dp_rank", "sightline.worker")  # resource attributes of their process, carried in the records
_SCOPE = InstrumentationScope("sightline", schema_url=SCHEMA_URL)
_KEEP = {
    outcomes.ERROR: "error",
    outcomes.ENGINE_FAILURE: "error",
    outcomes.UNAVAILABLE: "error",
    outcomes.CLIENT_DISCONNECT: "aborted",
    outcomes.TIMEOUT: "aborted",
    outcomes.SHUTDOWN: "aborted",
    outcomes.ABORTED_BY_OPERATOR: "aborted",
    outcomes.SHED: "shed",
}


@dataclass(frozen=True)
class TailPolicy:
    """What keeps a trace: its outcome, a missed objective of the request's own, or latency over the
    SLO thresholds (dashboards/slo.yaml)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def keep_reason(
        self, outcome: str, ttft_s: float | None, tpot_s: float | None, missed_slo: bool = False
    ) -> str | None:
        reason = _KEEP.get(outcome)
        if reason is not None:
            return reason
        if missed_slo:
            return "slo"
        if self.ttft_s is not None and ttft_s is not None and ttft_s > self.ttft_s:
            return "ttft"
        if self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s:
            return "tpot"
        return None


def slo_policy(ttft_ms: float | None, tpot_ms: float | None) -> TailPolicy:
    """Thresholds from the flags (ms; 0 turns one off), else the TTFT and TPOT SLOs of
    dashboards/slo.yaml, else 1 s and 100 ms."""
    spec, _ = slo_spec_goodput()
    ttft = spec.get("ttft_ms", 1000.0) if ttft_ms is None else ttft_ms
    tpot = spec.get("tpot_ms", 100.0) if tpot_ms is None else tpot_ms
    return TailPolicy(ttft / 1000.0 if ttft else None, tpot / 1000.0 if tpot else None)


class TailSampler:
    """Buffers the record-only spans of undecided traces; exports a trace once it is kept.

    `count(decision, reason)` is called once per decided trace (by the process that decides)
    and once per trace evicted undecided."""

    def __init__(
        self,
        processors: Sequence[SpanProcessor],
        base_resource: dict,
        max_traces: int,
        count: Callable[[str, str], None] | None = None,
    ) -> None:
        self.processors = list(processors)
        self.base_resource = base_resource
        self.max_traces = max(1, max_traces)
        self.count = count or (lambda decision, reason: None)
        self.pending: OrderedDict[str, list[SpanRecord]] = OrderedDict()
        self.decided: OrderedDict[str, bool] = OrderedDict()  # trace id → kept; the latest 8 x max_traces
        self._resources: dict[tuple, Resource] = {}
        self.exported = 0
        self.outbox: tuple[list[str], list[str]] | None = None  # (kept, dropped) trace ids, for a worker's hub

    @classmethod
    def exporting(
        cls, exporters: Sequence, base_resource: dict, max_traces: int, count: Callable[[str, str], None] | None = None
    ) -> "TailSampler":
        return cls([BatchSpanProcessor(e) for e in exporters], base_resource, max_traces, count)

    def add(self, rec: SpanRecord) -> None:
        """A finished span from any process; head-sampled ones were exported where they ended."""
        if rec.sampled:
            return
        kept = self.decided.get(rec.trace_id)
        if kept is not None:
            if kept:
                self._export([rec])
            return
        spans = self.pending.get(rec.trace_id)
        if spans is None:
            spans = self.pending[rec.trace_id] = []
            while len(self.pending) > self.max_traces:
                self.pending.popitem(last=False)
                self.count("dropped", "buffer_full")
        if len(spans) < MAX_SPANS_PER_TRACE:
            spans.append(rec)

    def decide(self, trace_id: str, reason: str | None, counted: bool = True) -> None:
        """The request of `trace_id` ended: export its trace (a `reason`) or drop it (None).
        `counted=False` where another process already counted this decision."""
        kept = reason is not None
        self.decided[trace_id] = kept
        self.decided.move_to_end(trace_id)
        while len(self.decided) > 8 * self.max_traces:
            self.decided.popitem(last=False)
        if self.outbox is not None:
            self.outbox[0 if kept else 1].append(trace_id)
        spans = self.pending.pop(trace_id, [])
        if kept and spans:
            self._export(spans)
        if counted:
            self.count("kept" if kept else "dropped", reason or "not_selected")

    def take_outbox(self) -> tuple[list[str], list[str]]:
        """The decisions made since the last call (a tokenizer worker sends them to the hub, which
        holds the engine's spans of its requests)."""
        out, self.outbox = self.outbox or ([], []), ([], [])
        return out

    def _export(self, records: list[SpanRecord]) -> None:
        for rec in records:
            span = self._readable(rec)
            for p in self.processors:
                p.on_end(span)
        self.exported += len(records)

    def _resource(self, rec: SpanRecord) -> Resource:
        where = tuple((k, rec.attributes[k]) for k in _WHERE if k in rec.attributes)
        key = (rec.role, rec.pid, where)
        res = self._resources.get(key)
        if res is None:
            res = self._resources[key] = Resource.create(
                {**self.base_resource, "sightline.process.role": rec.role, "process.pid": rec.pid, **dict(where)}
            )
        return res

    def _readable(self, rec: SpanRecord) -> ReadableSpan:
        """The record as the span its process would have exported (flags: sampled)."""
        flags = TraceFlags(TraceFlags.SAMPLED)
        trace_id = int(rec.trace_id, 16)
        parent = SpanContext(trace_id, int(rec.parent_span_id, 16), False, flags) if rec.parent_span_id else None
        links = []
        for ref in rec.link_ids:
            t, _, s = ref.partition("-")
            links.append(Link(SpanContext(int(t, 16), int(s, 16), False, flags)))
        code = StatusCode[rec.status] if rec.status in StatusCode.__members__ else StatusCode.UNSET
        return ReadableSpan(
            name=rec.name,
            context=SpanContext(trace_id, int(rec.span_id, 16), False, flags),
            parent=parent,
            resource=self._resource(rec),
            links=links,
            attributes={k: v for k, v in rec.attributes.items() if k not in _WHERE},
            kind=SpanKind[rec.kind] if rec.kind in SpanKind.__members__ else SpanKind.INTERNAL,
            status=Status(code, rec.status_message or None) if code is StatusCode.ERROR else Status(code),
            start_time=rec.start_ns,
            end_time=rec.end_ns,
            instrumentation_scope=_SCOPE,
        )

    def shutdown(self) -> None:
        for p in self.processors:
            p.shutdown()
