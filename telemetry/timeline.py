"""Recent requests' timelines, in memory: `/debug/requests` without any tracing backend.

Spans reach the buffer from every process (the main process's own, and the
children's forwarded in their stats messages) at different times, so entries are keyed
by trace id and the request's summary (rid, outcome, breakdown) joins its entry when the
TokenizerManager finishes it.  Bounded: the oldest entries go first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from protocol.io_struct import SpanRecord

MAX_SPANS_PER_TRACE = 2000


@dataclass
class TimelineEntry:
    trace_id: str
    spans: list[SpanRecord] = field(default_factory=list)
    summary: dict | None = None  # set when the request finished
    finished_at: float = 0.0  # wall time (s since the epoch) the summary joined


class Timeline:
    def __init__(self, size: int) -> None:
        self.size = size
        self._by_trace: OrderedDict[str, TimelineEntry] = OrderedDict()
        self._rid_to_trace: dict[str, str] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # trace ids with a summary, oldest first

    def _entry(self, trace_id: str) -> TimelineEntry:
        entry = self._by_trace.get(trace_id)
        if entry is None:
            entry = self._by_trace[trace_id] = TimelineEntry(trace_id)
            while len(self._by_trace) > max(self.size, 1) * 2:  # room for in-flight ones too
                _, old = self._by_trace.popitem(last=False)
                if old.summary:
                    self._rid_to_trace.pop(old.summary["rid"], None)
                    self._finished.pop(old.trace_id, None)
        return entry

    def add_span(self, rec: SpanRecord) -> None:
        belongs_to_a_request = (
            "sightline.rid" in rec.attributes or rec.kind == "SERVER" or rec.name == "stale_message_dropped"
        )
        if self.size == 0 or not belongs_to_a_request:
            return  # batch-level spans (one forward over many rids) live in their own traces
        entry = self._entry(rec.trace_id)
        if len(entry.spans) < MAX_SPANS_PER_TRACE:
            entry.spans.append(rec)

    def finish(self, trace_id: str, summary: dict) -> None:
        if self.size == 0:
            return
        entry = self._entry(trace_id)
        entry.summary, entry.finished_at = summary, time.time()
        self._rid_to_trace[summary["rid"]] = trace_id
        self._finished[trace_id] = None
        while len(self._finished) > self.size:  # O(1) per request: a scan of the buffer cost ~7 % of the TM
            old = self._by_trace.pop(self._finished.popitem(last=False)[0], None)
            if old is not None:
                self._rid_to_trace.pop(old.summary["rid"], None)

    def get(self, rid: str) -> dict | None:
        trace_id = self._rid_to_trace.get(rid)
        entry = self._by_trace.get(trace_id) if trace_id else None
        if entry is None:
            return None
        spans = sorted(entry.spans, key=lambda s: (s.start_ns, s.end_ns))
        return {**entry.summary, "trace_id": entry.trace_id, "spans": msgspec.to_builtins(spans)}

    def spans_of(self, trace_id: str) -> list[SpanRecord]:
        entry = self._by_trace.get(trace_id)
        return list(entry.spans) if entry else []

    def recent(self, limit: int = 100) -> list[dict]:
        done = [e for e in self._by_trace.values() if e.summary]
        return [
            {**e.summary, "trace_id": e.trace_id, "spans": len(e.spans), "finished_at": e.finished_at}
            for e in reversed(done[-limit:])
        ]
