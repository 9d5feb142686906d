"""What the main process knows about the engine, as plain data: no Prometheus here.

The `EngineMonitor` fills an `EngineView` at scrape time from the children's latest
stats messages (kept as they arrived) and the few numbers only the main process can
compute; `telemetry.metrics.EngineCollector` turns it into metrics (each spec's `read`
path).  The same split as vLLM v1's stats/loggers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.io_struct import DetokenizerStats, DropCount, SchedulerStats


@dataclass
class EngineView:
    scheduler: SchedulerStats | None = None  # the latest, as received
    detokenizer: DetokenizerStats | None = None
    throughput: float = 0.0  # tokens/s over the last few seconds, from the Scheduler's counter
    seconds_since_last_token: float = 0.0  # with requests in flight; 0 when idle
    stale_drops: list[DropCount] = field(default_factory=list)  # all three processes
    undecodable: dict[str, int] = field(default_factory=dict)  # by component
    handling_errors: dict[str, int] = field(default_factory=dict)  # by component
    heartbeat_age: dict[str, float] = field(default_factory=dict)  # seconds, by role
    rss: dict[str, float] = field(default_factory=dict)  # bytes, by process role
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds, by process role
