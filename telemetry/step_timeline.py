"""The engine's step timeline: a bounded ring of recent steps per Scheduler rank, and its
rendering as Chrome Trace Event JSON (GET /debug/timeline; Perfetto and chrome://tracing load it).

The Scheduler keeps its last --step-timeline-steps steps (`StepRing.add`, one tuple per
step; nothing is built until asked) and sends those of the last N seconds on a
`StepTimelineReq`.  `chrome_trace` renders every rank's into one file:

- one process per rank (`pid` = dp rank, named `scheduler dp<rank>`), one track (`tid` 0);
- one complete slice (`ph: X`) per step, `args`: its phases' ms, decode count, prefill
  tokens, retracted requests, its rids, prefill rids and trace ids; inside it one slice per
  phase (schedule, forward, sample, grammar, logprobs, output), laid end to end in that order
  (grammar: structured outputs' masks and token consumption; logprobs: the log-probabilities of
  sampled and prompt tokens; each absent from steps that had none);
- per traced request, a flow (`ph: s` at its first step, `t` at the next ones, `f` at its
  last; `id` = its trace id, `cat: request`) through every step that served it, so a step
  leads to the trace of each of its requests and back.

Timestamps are wall-clock µs (the monotonic stamps through one `WallAnchor`), so ranks align.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Protocol

from protocol.io_struct import StepRecord
from telemetry.clock import WallAnchor, now_ns

PHASES = ("schedule", "forward", "sample", "grammar", "logprobs", "verify", "output")


class Step(Protocol):
    """What the ring reads from an engine step (`serving.engine.events.StepStats`)."""

    started_ns: int
    ended_ns: int
    schedule_seconds: float
    forward_seconds: float
    sample_seconds: float
    logprobs_seconds: float
    grammar_seconds: float
    verify_seconds: float
    num_decode: int
    num_prefill_tokens: int
    num_retracted: int
    rids: tuple[str, ...]
    prefill_rids: tuple[str, ...]


def trace_id_of(carrier: dict[str, str]) -> str:
    """The trace id of a W3C carrier ("" when there is none)."""
    parts = carrier.get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 else ""


class StepRing:
    def __init__(self, size: int) -> None:
        self.steps: deque[tuple[Step, tuple[str, ...], int]] = deque(maxlen=max(size, 1))

    def add(self, st: Step, trace_ids: tuple[str, ...], output_ns: int) -> None:
        self.steps.append((st, trace_ids, output_ns))

    def since(self, seconds: float, now: int | None = None) -> list[StepRecord]:
        """The steps that ended in the last `seconds`, oldest first."""
        cutoff = (now if now is not None else now_ns()) - int(seconds * 1e9)
        out: list[StepRecord] = []
        for st, traces, output_ns in reversed(self.steps):
            if st.ended_ns < cutoff:
                break
            out.append(
                StepRecord(
                    st.started_ns,
                    st.ended_ns,
                    int(st.schedule_seconds * 1e9),
                    int(st.forward_seconds * 1e9),
                    int(st.sample_seconds * 1e9),
                    output_ns,
                    st.num_decode,
                    st.num_prefill_tokens,
                    st.num_retracted,
                    list(st.rids),
                    list(st.prefill_rids),
                    list(traces),
                    int(st.logprobs_seconds * 1e9),
                    int(st.grammar_seconds * 1e9),
                    int(st.verify_seconds * 1e9),
                )
            )
        out.reverse()
        return out


def _us(anchor: WallAnchor, mono_ns: int) -> float:
    return anchor.to_wall_ns(mono_ns) / 1e3


def chrome_trace(ranks: Iterable[tuple[int, list[StepRecord]]], anchor: WallAnchor | None = None) -> dict:
    """Chrome Trace Event JSON (the object form) of every rank's steps."""
    anchor = anchor or WallAnchor.take()
    events: list[dict] = []
    for rank, steps in ranks:
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"scheduler dp{rank}"}}
        )
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "engine steps"}})
        last_step = {}  # trace id → index of its last step here
        for i, s in enumerate(steps):
            for t in s.trace_ids:
                if t:
                    last_step[t] = i
        seen: set[str] = set()
        for i, s in enumerate(steps):
            ts, dur = _us(anchor, s.start), max((s.end - s.start) / 1e3, 0.001)
            phases = dict(zip(PHASES, (s.schedule, s.forward, s.sample, s.grammar, s.logprobs, s.verify, s.output)))
            events.append(
                {
                    "ph": "X",
                    "name": "step",
                    "cat": "step",
                    "pid": rank,
                    "tid": 0,
                    "ts": ts,
                    "dur": dur,
                    "args": {
                        **{f"{p}_ms": round(ns / 1e6, 3) for p, ns in phases.items()},
                        "decode": s.num_decode,
                        "prefill_tokens": s.prefill_tokens,
                        "retracted": s.retracted,
                        "rids": s.rids,
                        "prefill_rids": s.prefill_rids,
                        "trace_ids": s.trace_ids,
                    },
                }
            )
            at = ts
            for p, ns in phases.items():
                if ns > 0:
                    events.append(
                        {"ph": "X", "name": p, "cat": "phase", "pid": rank, "tid": 0, "ts": at, "dur": ns / 1e3}
                    )
                    at += ns / 1e3
            for rid, t in zip(s.rids, s.trace_ids):
                if not t:
                    continue
                ph = "s" if t not in seen else "f" if last_step[t] == i else "t"
                if ph == "s" and last_step[t] == i:
                    continue  # one step only: a flow needs two ends
                seen.add(t)
                flow = {
                    "ph": ph,
                    "name": "request",
                    "cat": "request",
                    "id": t,
                    "pid": rank,
                    "tid": 0,
                    "ts": ts + dur / 2,
                    "args": {"rid": rid, "trace_id": t},
                }
                if ph != "s":
                    flow["bp"] = "e"  # binds to the enclosing step slice
                events.append(flow)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "sightline", "clock": "wall-clock µs"},
    }
