"""Decode gaps that arise after the Scheduler: the Detokenizer's lag, the TokenizerManager's loop, an engine
restart.

The Scheduler finds the gaps between the tokens it samples (`serving.engine.decode_gaps`); a
client sees the gaps between the outputs the TokenizerManager receives, and those also
grow when the Detokenizer falls behind or the TokenizerManager's event loop is held.  Every
output carries the stamps to tell them apart: the Scheduler sent it (`sched_sent`), the
Detokenizer sent it on (`detok_done`, stamped just before the send), the TokenizerManager received it (`recv`).

A gap between two outputs of a request is long when it exceeds `max(factor × median, floor)`
(the median of this process's last `window` gaps, updated every `MEDIAN_EVERY` outputs; the
factor and floor are the Scheduler's, --decode-gap-factor and --decode-gap-floor).  It is
counted here when over half of it passed after the Scheduler sent the output that ended it
(`recv − sched_sent`; a few ms when nothing lags): cause `detokenizer` when most of that is
Scheduler sent → Detokenizer done (its socket's queue, a stopped or starved process), else
`main_loop` (Detokenizer done → received: the TokenizerManager's loop did not read its socket,
held by a blocking callback, a GC pause, a backlog, the process stopped).  A gap mostly made
before the Scheduler sent it is the Scheduler's to count.

`engine_restart`: an engine failure ends every request in flight (the streams end with an
error, then the engine restarts), so no gap spans a restart; a stream that had its first
token and was cut that way counts one `engine_restart` gap, its last token → the failure.

Counted by (the request's dp_rank, cause) into `sightline_decode_gaps_total`; the request's
server span gets a `decode_gap` event (at most `MAX_EVENTS` per request).  Per output the
cost is a subtraction, a deque append and a comparison; no state per request but its count
of events.
"""

from __future__ import annotations

from collections import deque
from statistics import median_low
from typing import Callable

from opentelemetry.trace import Span

from protocol.io_struct import DOWNSTREAM_GAP_CAUSES, GapCount, Stamps

MEDIAN_EVERY = 32  # outputs between two updates of the median (it moves slowly)
MAX_EVENTS = 16  # decode_gap events per request's span; the counter counts every gap


class DownstreamGaps:
    def __init__(
        self, factor: float = 4.0, floor_s: float = 0.05, window: int = 64, wall: Callable[[int], int] = lambda ns: ns
    ) -> None:
        self.factor = factor
        self.wall = wall  # monotonic ns -> wall ns (span event times)
        self.floor_ns = int(floor_s * 1e9)
        self.threshold_ns = self.floor_ns
        self.gaps: deque[int] = deque(maxlen=window)
        self.counts: dict[tuple[int, str], int] = {}
        self._n = 0

    def output(self, rt, st: Stamps, recv: int) -> str | None:
        """A non-first output of `rt` with tokens arrived at `recv`: a downstream gap's cause, or None."""
        gap = recv - rt.trace.last_recv
        self.gaps.append(gap)
        self._n += 1
        if self._n % MEDIAN_EVERY == 0 or self._n < MEDIAN_EVERY:
            self.threshold_ns = max(int(self.factor * median_low(self.gaps)), self.floor_ns)
        if gap <= self.threshold_ns:
            return None
        sent, done = st.sched_sent, st.detok_done
        if sent is None or done is None or recv - sent <= gap / 2:
            return None
        detok, loop = done - sent, recv - done
        cause = "detokenizer" if detok >= loop else "main_loop"
        self._count(rt, cause, gap, recv, detok, loop)
        return cause

    def cut(self, rt, end: int) -> None:
        """`rt` ended by an engine failure at `end`: an engine_restart gap if it had streamed a token."""
        if rt.trace.last_recv is not None:
            self._count(rt, "engine_restart", end - rt.trace.last_recv, end, 0, 0)

    def _count(self, rt, cause: str, gap: int, at: int, detok: int, loop: int) -> None:
        key = (rt.dp_rank, cause)
        self.counts[key] = self.counts.get(key, 0) + 1
        span: Span | None = rt.trace.span
        if span is not None and rt.trace.gap_events < MAX_EVENTS:
            rt.trace.gap_events += 1
            span.add_event(
                "decode_gap",
                {
                    "sightline.decode_gap.seconds": gap / 1e9,
                    "sightline.decode_gap.cause": cause,
                    "sightline.decode_gap.detokenizer_seconds": max(0, detok) / 1e9,
                    "sightline.decode_gap.main_loop_seconds": max(0, loop) / 1e9,
                },
                timestamp=self.wall(at),
            )

    def snapshot(self) -> list[GapCount]:
        return [GapCount(cause, n, rank) for (rank, cause), n in sorted(self.counts.items())]


def merge(counts: list[GapCount], ranks: tuple[int, ...] = ()) -> list[GapCount]:
    """Several tokenizer workers' counts as one list: summed by (dp_rank, cause); with `ranks`, every
    downstream cause of each of those ranks is there (at 0 until counted)."""
    out: dict[tuple[int, str], int] = {(r, c): 0 for r in ranks for c in DOWNSTREAM_GAP_CAUSES}
    for g in counts:
        out[(g.dp_rank, g.cause)] = out.get((g.dp_rank, g.cause), 0) + g.count
    return [GapCount(cause, n, rank) for (rank, cause), n in sorted(out.items())]
