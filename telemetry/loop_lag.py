"""Event-loop lag of a front-end process (the main process, or one tokenizer worker), sampled
continuously.

A task sleeps `interval` seconds and records how much later than asked it woke.  Any
callback that holds the loop (a long tokenization, a huge JSON body, a slow handler, a
garbage-collection pause) shows up here as lag — and every stream the front end serves
waits exactly that long.  Observed into `sightline_event_loop_lag_seconds{role}`; the
latest and the worst value are shown in `/debug/state`.

Samples above `slow` seconds are also kept, with the monotonic time they were taken, in
a bounded deque: `worst_between` says how long the loop stalled during one request, and
the request's server span carries it (`sightline.event_loop.lag_max_seconds`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

INTERVAL = 0.05
SLOW = 0.1  # seconds: lags above this are kept for `worst_between` (and reach the request's span)
KEEP = 1024  # slow samples kept (one per stall: minutes of a loop that stalls all the time)


class LoopLagMonitor:
    def __init__(
        self, observe: Callable[[float], None] | None, interval: float = INTERVAL, slow: float = SLOW, keep: int = KEEP
    ) -> None:
        self.observe = observe
        self.interval = interval
        self.slow = slow
        self.last = 0.0
        self.worst = 0.0
        self.stalls: deque[tuple[int, float]] = deque(maxlen=keep)  # (monotonic ns at wake-up, lag in seconds)
        self._asked_ns: int | None = None  # when the sampling task asked to wake (None: not sleeping)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sightline-loop-lag")

    async def _run(self) -> None:
        step = int(self.interval * 1e9)
        while True:
            self._asked_ns = time.monotonic_ns() + step  # the clock of asyncio's loop.time()
            await asyncio.sleep(self.interval)
            woke = time.monotonic_ns()
            self.record(woke, max(0.0, (woke - self._asked_ns) / 1e9))

    def record(self, at_ns: int, lag: float) -> None:
        """One sample: `lag` seconds late, observed at monotonic `at_ns`."""
        self.last, self.worst = lag, max(self.worst, lag)
        if lag > self.slow:
            self.stalls.append((at_ns, lag))
        if self.observe is not None:
            self.observe(lag)

    def worst_between(self, start_ns: int, end_ns: int) -> float | None:
        """The longest stall above `slow` that overlapped [start_ns, end_ns] (monotonic ns), or None.

        A stall sampled at `t` with lag `l` held the loop over [t - l, t].  A stall still under
        way (the sampling task overdue now) counts with its length so far, so a request that
        ends right after a blocking callback, before the task has run, still sees it."""
        worst: float | None = None
        for at, lag in reversed(self.stalls):
            if at < start_ns:
                break
            if at - lag * 1e9 <= end_ns and (worst is None or lag > worst):
                worst = lag
        asked = self._asked_ns
        if asked is not None and asked <= end_ns:
            pending = (min(time.monotonic_ns(), end_ns) - asked) / 1e9
            if pending > self.slow and (worst is None or pending > worst):
                worst = pending
        return worst

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._asked_ns = None
