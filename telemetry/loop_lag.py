"""Event-loop lag of the main process, sampled continuously.

A task sleeps `interval` seconds and records how much later than asked it woke.  Any
callback that holds the loop (a long tokenization, a huge JSON body, a slow handler)
shows up here as lag — and every stream the front end serves waits exactly that long.
Observed into `sightline_event_loop_lag_seconds`; the latest and the worst value are
shown in `/debug/state`.
"""

from __future__ import annotations

import asyncio
from typing import Callable

INTERVAL = 0.05


class LoopLagMonitor:
    def __init__(self, observe: Callable[[float], None] | None, interval: float = INTERVAL) -> None:
        self.observe = observe
        self.interval = interval
        self.last = 0.0
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sightline-loop-lag")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            lag = max(0.0, loop.time() - asked)
            self.last, self.worst = lag, max(self.worst, lag)
            if self.observe is not None:
                self.observe(lag)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
