"""Decode gaps after the Scheduler, from the stamps every output carries: the Detokenizer's lag and the
TokenizerManager's loop told apart, a gap mostly the Scheduler's left to it, a stream cut by an engine failure."""

from __future__ import annotations

from types import SimpleNamespace

from protocol.io_struct import Stamps
from telemetry.downstream_gaps import DownstreamGaps, merge
from telemetry.request_trace import RequestTrace

MS = 1_000_000


class Span:
    def __init__(self) -> None:
        self.events: list = []

    def add_event(self, name, attributes, timestamp=None):
        self.events.append((name, attributes))


def request(rank: int = 0):
    return SimpleNamespace(dp_rank=rank, trace=RequestTrace(span=Span()))


def feed(gaps: DownstreamGaps, rt, sent: int, done: int, recv: int) -> str | None:
    cause = gaps.output(rt, Stamps(sched_sent=sent, detok_done=done), recv) if rt.trace.last_recv is not None else None
    rt.trace.last_recv = recv
    return cause


def steady(gaps: DownstreamGaps, rt, t: int, n: int = 20) -> int:
    for _ in range(n):  # a token every 10 ms, 1 ms to detokenize, 1 ms to read
        t += 10 * MS
        assert feed(gaps, rt, t, t + MS, t + 2 * MS) is None
    return t


def test_a_stopped_detokenizer_and_a_held_loop_are_told_apart():
    gaps, rt = DownstreamGaps(factor=4, floor_s=0.05), request(rank=1)
    t = steady(gaps, rt, 0)
    t += 10 * MS
    assert feed(gaps, rt, t, t + 500 * MS, t + 501 * MS) == "detokenizer"  # sent in time, decoded 0.5 s late
    t = steady(gaps, rt, t + 500 * MS)
    t += 10 * MS
    assert feed(gaps, rt, t, t + MS, t + 400 * MS) == "main_loop"  # decoded in time, read 0.4 s late
    t = steady(gaps, rt, t + 400 * MS)
    t += 300 * MS  # the Scheduler's own gap: the stamps downstream did not grow
    assert feed(gaps, rt, t, t + MS, t + 2 * MS) is None
    assert {(g.dp_rank, g.cause, g.count) for g in gaps.snapshot()} == {(1, "detokenizer", 1), (1, "main_loop", 1)}
    causes = [e[1]["sightline.decode_gap.cause"] for e in rt.trace.span.events]
    assert causes == ["detokenizer", "main_loop"]
    assert rt.trace.span.events[0][1]["sightline.decode_gap.detokenizer_seconds"] > 0.45


def test_a_stream_cut_by_an_engine_failure_counts_one_restart_gap():
    gaps, streamed, queued = DownstreamGaps(), request(), request()
    steady(gaps, streamed, 0, 3)
    gaps.cut(streamed, 10**9)
    gaps.cut(queued, 10**9)  # no token yet: no gap
    assert [(g.cause, g.count) for g in gaps.snapshot()] == [("engine_restart", 1)]
    a, b = DownstreamGaps(), DownstreamGaps()
    for g in (a, b):
        g.cut(streamed, 10**9)
    assert [(g.cause, g.count) for g in merge(a.snapshot() + b.snapshot())] == [("engine_restart", 2)]
