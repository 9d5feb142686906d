"""What the main process knows about the engine, as plain data: no Prometheus here.

The `EngineMonitor` fills an `EngineView` at scrape time from the children's latest
stats messages (kept as they arrived) and the few numbers only the main process can
compute; `telemetry.metrics.EngineCollector` turns it into metrics (each spec's `read`
path).  The same split as vLLM v1's stats/loggers.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from protocol.io_struct import (
    DetokenizerStats,
    DropCount,
    GapCount,
    PhaseHistogram,
    Ready,
    SchedulerStats,
    StartupPhase,
)


@dataclass
class EngineView:
    schedulers: list[SchedulerStats] = field(default_factory=list)  # each rank's latest, by dp_rank
    detokenizer: DetokenizerStats | None = None
    throughput: float = 0.0  # tokens/s over the last few seconds, from the Scheduler's counter
    seconds_since_last_token: float = 0.0  # with requests in flight; 0 when idle
    stale_drops: list[DropCount] = field(default_factory=list)  # all three processes
    undecodable: dict[str, int] = field(default_factory=dict)  # by component
    handling_errors: dict[str, int] = field(default_factory=dict)  # by component
    heartbeat_age: dict[str, float] = field(default_factory=dict)  # seconds, by role
    rss: dict[str, float] = field(default_factory=dict)  # bytes, by process role
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds, by process role
    engine_info: list[Ready] = field(default_factory=list)  # the Scheduler's Ready: model, dtype, quantization
    decode_gaps: list[GapCount] = field(default_factory=list)  # every rank's and the front's, dp_rank set
    startup_phases: list[StartupPhase] = field(default_factory=list)  # each process's latest start, by phase

    # -- the whole server's numbers, one per pod whatever --dp-size (an inference router reads these) --
    @property
    def server_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def server_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def server_kv_usage(self) -> float:
        """Slots in use (used less the evictable cached ones) ÷ capacity, over every rank."""
        total = sum(s.kv_total for s in self.schedulers)
        held = sum(max(0, s.kv_used - s.prefix_evictable_tokens) for s in self.schedulers)
        return held / total if total else 0.0


class PhaseTimes:
    """Histograms of engine-step phases, kept in the Scheduler and sent whole in its stats
    (cumulative, like a Prometheus histogram: a lost stats message loses nothing)."""

    def __init__(self, phases: tuple[str, ...], bounds: tuple[float, ...], kind: type = PhaseHistogram) -> None:
        self.bounds = list(bounds)
        self.kind = kind  # PhaseHistogram, or a struct of the same fields under another first label (MethodHistogram)
        self.hist = {p: kind(p, self.bounds, [0] * (len(bounds) + 1), 0.0) for p in phases}

    def observe(self, phase: str, seconds: float) -> None:
        h = self.hist[phase]
        h.counts[bisect_left(self.bounds, seconds)] += 1  # le semantics: a value equal to a bound is in it
        h.sum += seconds

    def snapshot(self) -> list[PhaseHistogram]:
        return [self.kind(p, h.bounds, list(h.counts), h.sum) for p, h in self.hist.items()]
