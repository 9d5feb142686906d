"""A process's start, phase by phase: the clock behind `sightline_startup_phase_seconds`.

One `PhaseClock` per process (`start`), set where the process's own code begins; the code
that starts it then says which phase it enters (`begin`, a no-op in a process without a
clock, so library code such as the model runner can mark its phases unconditionally).
The first phase, `imports`, runs from the process's creation (the OS's clock) to the
clock's start: the interpreter, the spawn bootstrap and every module imported before it.

A child reports each phase it enters (`StartupProgress`, so /health can say where a slow
start is) and every phase's length with its Ready; the phases also become spans, a root
`startup` span with one child per phase, recorded once the start is over.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from protocol.io_struct import StartupPhase, StartupProgress
from telemetry.clock import now_ns


def process_started_ns() -> int:
    """This process's creation time on the monotonic clock (`now_ns`), from the OS's wall-clock record."""
    import psutil  # lazily: only a starting process asks

    age = max(0.0, time.time() - psutil.Process().create_time())
    return now_ns() - int(age * 1e9)


@dataclass
class PhaseClock:
    """The phases of one process's start, in order; `current` is the one under way ("" once done)."""

    role: str
    started_ns: int  # when the first phase began (monotonic ns)
    on_phase: Callable[[str], None] | None = None  # told each phase as it begins (the child's progress message)
    marks: list[tuple[str, int, int]] = field(default_factory=list)  # (phase, start ns, end ns), ended phases
    current: str = ""
    _since: int = 0

    def begin(self, phase: str, at: int | None = None) -> None:
        """End the phase under way (if any) and begin `phase`."""
        at = now_ns() if at is None else at
        self._end(at)
        self.current, self._since = phase, at
        if self.on_phase is not None:
            self.on_phase(phase)

    def finish(self) -> list[StartupPhase]:
        """End the phase under way and stop reporting (the start is over: its channel may close); every
        phase's length (a second call changes nothing)."""
        self._end(now_ns())
        self.on_phase = None
        return self.phases()

    def phases(self) -> list[StartupPhase]:
        return [StartupPhase(self.role, name, (end - start) / 1e9) for name, start, end in self.marks]

    def _end(self, at: int) -> None:
        if self.current:
            self.marks.append((self.current, self._since, max(at, self._since)))
            self.current = ""

    def record_spans(self, tracing) -> None:
        """The start as spans (a `telemetry.tracing.Tracing`): a root `startup` span and one child per phase."""
        if not self.marks or not getattr(tracing, "enabled", False):
            return
        from opentelemetry import trace

        first, last = self.marks[0][1], self.marks[-1][2]
        attrs = {"sightline.process.role": self.role}
        root = tracing.start("startup", None, attributes=attrs, start_mono=first)
        ctx = trace.set_span_in_context(root)
        for name, start, end in self.marks:
            tracing.record(f"startup.{name}", ctx, start, end, attributes={**attrs, "sightline.startup.phase": name})
        root.end(end_time=tracing.wall(last))


_clock: PhaseClock | None = None


def start(role: str, on_phase: Callable[[str], None] | None = None, first: str = "imports") -> PhaseClock:
    """This process's clock: phase `first` from the process's creation until now, the next phase up to the caller."""
    global _clock
    _clock = PhaseClock(role, process_started_ns(), on_phase)
    _clock.begin(first, at=_clock.started_ns)
    return _clock


def clock() -> PhaseClock | None:
    return _clock


def begin(phase: str) -> None:
    """Mark the start of `phase` in this process's start (nothing without a clock, once it is over, or inside
    `counted_as`)."""
    if _clock is not None and (_clock.current or not _clock.marks) and not _holding:
        _clock.begin(phase)


_holding = False  # inside `counted_as`: the phases code there begins are part of its phase


@contextmanager
def counted_as(phase: str) -> Iterator[None]:
    """Begin `phase`, and count in it the phases the code inside would begin: a second model's load (a draft's
    native_kernels, weight_load, kv_pool) is one phase of its own, not a second copy of the target's."""
    global _holding
    begin(phase)
    _holding = True
    try:
        yield
    finally:
        _holding = False


def report_phases(role: str, send: Callable[[StartupProgress], None]) -> PhaseClock:
    """A child's clock (started here if its entry point did not), now telling the supervisor each phase it
    begins through `send`, the phase under way first."""
    c = _clock or start(role)

    def progress(phase: str) -> None:
        send(StartupProgress(role=role, pid=os.getpid(), phase=phase))

    c.on_phase = progress
    if c.current:
        progress(c.current)
    return c
