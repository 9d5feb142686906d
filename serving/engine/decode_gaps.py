"""Decode gaps: an inter-token gap well above the rank's typical step, and what caused it.

A request's gap between two output tokens is *long* when it exceeds
`max(factor × median step interval, floor)`: the median over the rank's last `window`
step-to-step intervals (end of one step to the end of the next: what a decoding request
sees between two tokens when nothing gets in its way), with an absolute floor so that a
fast engine's noise is not flagged.  Defaults: factor 4, floor 50 ms, window 64 steps
(--decode-gap-factor, --decode-gap-floor).

Its cause, from the steps that ended inside the gap (the first that applies):

- `retraction`: the request was retracted in between (it waited in the queue, then recomputed);
- `paused`: the Scheduler was paused in between (POST /pause_generation mode in_place);
- `prefill`: those steps co-scheduled prefill chunks; the culprits are the requests prefilled;
- `scheduler_loop`: more than half the gap passed outside any step (the Scheduler's loop
  receiving, sending outputs and stats, a GC pause, the CPU taken by another process);
- `batch_size`: those steps ran more than twice the recent median batch;
- `slow_step`: none of those: the forward itself took long.

What happens after the Scheduler (Detokenizer lag, the TokenizerManager's loop, an engine
restart) is not seen here: `telemetry.downstream_gaps` finds those.  Every gap is counted by
cause; the request keeps its `MAX_GAPS` longest (its `decode` span's events).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median_low
from typing import Iterable

from protocol.io_struct import ENGINE_GAP_CAUSES, GapCount
from serving.engine.events import StepStats, TokenEvent

MAX_GAPS = 16  # the longest gaps kept per request (its span events); the counters count every one
MAX_CULPRITS = 8  # rids named per gap
STEPS_KEPT = 512  # recent steps a gap's cause is looked up in
MAX_PAUSES = 16
MEDIAN_EVERY = 8  # steps between two updates of the medians


@dataclass(frozen=True)
class GapRules:
    factor: float = 4.0
    floor_s: float = 0.05
    window: int = 64


@dataclass(frozen=True)
class DecodeGap:
    start: int  # monotonic ns: the request's previous token
    end: int  # this token
    cause: str
    culprits: tuple[str, ...] = ()  # the requests prefilled in between (cause prefill)
    prefill_tokens: int = 0  # prompt tokens the steps in between prefilled
    batch_size: int = 0  # the largest batch in between
    steps: int = 0  # steps that ended in between

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


def keep(gaps: list[DecodeGap], gap: DecodeGap) -> None:
    """Keep the request's `MAX_GAPS` longest gaps (in the order they happened)."""
    if len(gaps) < MAX_GAPS:
        gaps.append(gap)
        return
    i = min(range(len(gaps)), key=lambda j: gaps[j].end - gaps[j].start)
    if gap.end - gap.start > gaps[i].end - gaps[i].start:
        del gaps[i]
        gaps.append(gap)


class DecodeGaps:
    """Watches every step's sampled tokens for long gaps (`stepped`); counts them by cause."""

    def __init__(self, rules: GapRules | None = None) -> None:
        self.rules = rules or GapRules()
        self.steps: deque[StepStats] = deque(maxlen=STEPS_KEPT)
        self.intervals: deque[int] = deque(maxlen=self.rules.window)
        self.batches: deque[int] = deque(maxlen=self.rules.window)
        self.pauses: deque[tuple[int, int]] = deque(maxlen=MAX_PAUSES)
        self.counts = dict.fromkeys(ENGINE_GAP_CAUSES, 0)
        self.threshold_ns = int(self.rules.floor_s * 1e9)
        self._floor_ns = self.threshold_ns
        self._median_batch = 0
        self._n = 0

    def paused(self, start: int, end: int) -> None:
        """The Scheduler ran no step in [start, end]."""
        self.pauses.append((start, end))

    def stepped(self, st: StepStats, events: Iterable[TokenEvent]) -> list[DecodeGap]:
        """A step ran: find its long gaps (against the steps before it), then count the step in."""
        if not st.batch_size:
            return []
        self.steps.append(st)
        found = []
        for ev in events:
            tt = ev.req.times.token_times
            if ev.new_token_ids and len(tt) >= 2 and tt[-1] - tt[-2] > self.threshold_ns:
                gap = self._explain(ev.req, tt[-2], tt[-1])
                self.counts[gap.cause] += 1
                keep(ev.req.times.gaps, gap)
                found.append(gap)
        if len(self.steps) > 1:
            self.intervals.append(st.ended_ns - self.steps[-2].ended_ns)
            self.batches.append(st.batch_size)
            self._n += 1
            if self._n % MEDIAN_EVERY == 0 or self._n < MEDIAN_EVERY:  # the medians move slowly: not every step
                self.threshold_ns = max(int(self.rules.factor * median_low(self.intervals)), self._floor_ns)
                self._median_batch = median_low(self.batches)
        return found

    def _explain(self, req, a: int, b: int) -> DecodeGap:
        between: list[StepStats] = []
        for s in reversed(self.steps):
            if s.ended_ns <= a:
                break
            if s.ended_ns <= b:
                between.append(s)
        culprits: dict[str, None] = {}
        for s in reversed(between):
            for rid in s.prefill_rids:
                if rid != req.rid:
                    culprits[rid] = None
        prefill = sum(s.num_prefill_tokens for s in between)
        batch = max((s.batch_size for s in between), default=0)
        busy = sum(s.ended_ns - s.started_ns for s in between)
        if any(a < r.at <= b for r in req.times.retractions):
            cause = "retraction"
        elif any(p0 < b and p1 > a for p0, p1 in self.pauses):
            cause = "paused"
        elif culprits:
            cause = "prefill"
        elif (b - a) - busy > (b - a) / 2:
            cause = "scheduler_loop"
        elif self._median_batch and batch > 2 * self._median_batch:
            cause = "batch_size"
        else:
            cause = "slow_step"
        return DecodeGap(
            a, b, cause, tuple(culprits)[:MAX_CULPRITS] if cause == "prefill" else (), prefill, batch, len(between)
        )

    def snapshot(self) -> list[GapCount]:
        return [GapCount(cause, n) for cause, n in self.counts.items()]
