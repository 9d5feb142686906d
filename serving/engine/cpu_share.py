"""Each request's share of the engine's CPU time, for per-tenant accounting.

The rule: one engine step's CPU time (the Scheduler process's, every thread: the forward's
compute threads included, read with `time.process_time_ns` around the step) is split
between the requests of its batch in proportion to the tokens it fed each (one per
decode, a prefill chunk's length); the integer remainder goes to the last.  So the shares
of one step add up to that step's CPU time exactly, and a request's total is the sum over
the steps it was in.  Time outside steps (receiving, idle heartbeats) is nobody's.
"""

from __future__ import annotations


class CpuLedger:
    def __init__(self) -> None:
        self.ns: dict[str, int] = {}  # rid -> CPU ns so far

    def charge(self, rids: tuple[str, ...], tokens: tuple[int, ...], cpu_ns: int) -> None:
        total = sum(tokens)
        if not total or cpu_ns <= 0:
            return
        given = 0
        for i, (rid, n) in enumerate(zip(rids, tokens)):
            share = cpu_ns - given if i == len(rids) - 1 else cpu_ns * n // total
            given += share
            self.ns[rid] = self.ns.get(rid, 0) + share

    def of(self, rid: str, done: bool) -> int:
        """The rid's CPU ns so far; forgotten when `done`."""
        return self.ns.pop(rid, 0) if done else self.ns.get(rid, 0)
