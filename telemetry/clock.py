"""The clocks every process stamps requests with.

Intervals that cross processes use CLOCK_MONOTONIC (`time.monotonic_ns`), which all
processes of one host share; spans need wall time, so an anchor pair taken once lets
one convert a monotonic stamp to wall time without reading two clocks per event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

now_ns = time.monotonic_ns


@dataclass(frozen=True)
class WallAnchor:
    mono_ns: int
    wall_ns: int

    @classmethod
    def take(cls) -> "WallAnchor":
        return cls(time.monotonic_ns(), time.time_ns())

    def to_wall_ns(self, mono_ns: int) -> int:
        return self.wall_ns + (mono_ns - self.mono_ns)


def seconds_between(start_ns: int | None, end_ns: int | None) -> float | None:
    """Interval in seconds, or None when either end was never stamped."""
    if start_ns is None or end_ns is None:
        return None
    return (end_ns - start_ns) / 1e9
