"""Test-only seams of the engine, off unless their environment variable is set (as the fault seed is).

They let an end-to-end test make "a request is still running when X happens" a precondition it
checks, instead of a race it hopes to win with a long stream:

- `SIGHTLINE_TEST_HOLD_SEED=N`: a request whose sampling seed is N is *held*: it stops before its
  last token (after `max_new_tokens - 1`, at least one) and stays running, keeping its KV and its
  place in the batch, until it is cut (disconnect, timeout, abort, pause in mode abort, SIGTERM's
  grace, a kill) or released (`ReleaseHeldReq` on the Scheduler's socket, `tests.server_util.ServerProc.release`).
  A held request is never retracted.  The Scheduler reports how many it holds (`SchedulerStats.held`,
  on /debug/state), and the stall check does not count a held request as stuck.
- `SIGHTLINE_TEST_STEP_FLOOR_MS=N`: every engine step that runs a batch lasts at least N ms (the
  Scheduler sleeps the rest), so tokens keep flowing during an event however fast the engine is.
- `SIGHTLINE_TEST_STOP_ADMISSION_SEED=N`: while a request whose sampling seed is N runs, admission
  takes no new request, room or not (a fault: the queue freezes while that request's tokens trickle
  out, the shape of a stuck scheduler that /health's token check cannot see).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HOLD_SEED_ENV = "SIGHTLINE_TEST_HOLD_SEED"
STEP_FLOOR_ENV = "SIGHTLINE_TEST_STEP_FLOOR_MS"
STOP_ADMISSION_ENV = "SIGHTLINE_TEST_STOP_ADMISSION_SEED"


@dataclass(frozen=True)
class Seams:
    hold_seed: int | None = None
    step_floor_s: float = 0.0
    stop_admission_seed: int | None = None

    @classmethod
    def from_env(cls) -> Seams:
        hold, floor = os.environ.get(HOLD_SEED_ENV), os.environ.get(STEP_FLOOR_ENV)
        stop = os.environ.get(STOP_ADMISSION_ENV)
        return cls(int(hold) if hold else None, float(floor) / 1000 if floor else 0.0, int(stop) if stop else None)

    def holds(self, seed: int | None) -> bool:
        """A request with this sampling seed is to be held."""
        return self.hold_seed is not None and seed == self.hold_seed

    def stops_admission(self, running: list) -> bool:
        """A running request carries the admission-stop seed: this step admits no one."""
        return self.stop_admission_seed is not None and any(r.params.seed == self.stop_admission_seed for r in running)
