"""Why a waiting request was not admitted: one reason per request per step, time per reason.

Every step, `BatchBuilder.admit` gives each request left in the queue the reason it was
not admitted (`WaitReasons.assign`):

- `kv_capacity`: the head of the queue did not fit in the KV available (its expected need,
  `serving.engine.admission`, plus the running requests');
- `queue_order`: a request behind a head that waits for KV (admission is strict FCFS:
  nothing overtakes it);
- `running_limit`: --max-running-requests run already (every waiting request);
- `step_budget`: the step's prefill budget was spent (every waiting request);
- `retracted`: the step retracted requests, and a step that retracts admits no one;
- `paused`: the Scheduler is paused (POST /pause_generation mode in_place): no step runs;
- `next_step`: the request arrived while a step ran and was admitted by the next one
  (its whole wait is the rest of that step);
- `grammar`: its structured output's grammar was still compiling (serving.engine.grammar);
  admission passes over it, so it holds back no one, and it takes precedence over the
  reasons above (whatever else held the queue, it could not have run).

A `WaitLedger` on the request's times accumulates ns per reason over every waiting
interval, with the same stamps as `ReqTimes.waits`, so the reasons sum exactly to the
queue time.  Reason changes are kept (at most `MAX_CHANGES` per request) for the `queue`
spans' events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

KV_CAPACITY, QUEUE_ORDER, RUNNING_LIMIT, STEP_BUDGET = "kv_capacity", "queue_order", "running_limit", "step_budget"
RETRACTED, PAUSED, NEXT_STEP, GRAMMAR = "retracted", "paused", "next_step", "grammar"
WAIT_REASONS = (KV_CAPACITY, QUEUE_ORDER, RUNNING_LIMIT, STEP_BUDGET, RETRACTED, PAUSED, NEXT_STEP, GRAMMAR)
GLOBAL_REASONS = frozenset((RUNNING_LIMIT, STEP_BUDGET, RETRACTED, PAUSED))  # they hold back every waiting request
MAX_CHANGES = 32  # reason changes kept per request (span events); the times per reason are always complete


@dataclass
class WaitLedger:
    """Time per wait reason of one request (ns), and its reason changes [(at, reason)]."""

    ns: dict[str, int] = field(default_factory=dict)
    changes: list[tuple[int, str]] = field(default_factory=list)
    reason: str | None = None  # the open period's reason (None: not decided yet)
    since: int | None = None  # the open period's start (None: the waiting interval's start)

    def set(self, reason: str, at: int, waiting_since: int) -> None:
        if reason == self.reason:
            return
        start = self.since if self.since is not None else waiting_since
        if self.reason is not None:
            self._add(self.reason, at - start)
            start = at
        # an undecided start goes to the first reason decided: the request waited for it from the start
        self.reason, self.since = reason, start
        if len(self.changes) < MAX_CHANGES:
            self.changes.append((start, reason))

    def close(self, at: int, waiting_since: int) -> None:
        """The waiting interval ended at `at` (admitted, or ended in the queue)."""
        start = self.since if self.since is not None else waiting_since
        self._add(self.reason or NEXT_STEP, at - start)
        self.reason = self.since = None

    def _add(self, reason: str, ns: int) -> None:
        self.ns[reason] = self.ns.get(reason, 0) + max(0, ns)


def assign(waiting: Iterable, blocked: str | None, at: int) -> None:
    """Give every request still waiting its reason for this step.

    `blocked`: why the queue's head was not admitted (None: every request left waits for its
    grammar, or the queue is empty).  A global reason holds back everyone; `kv_capacity` holds
    back the head, and the rest wait behind it (`queue_order`).  A request whose grammar is
    still compiling waits for it (`grammar`) and is no one's head.
    """
    behind = blocked if blocked in GLOBAL_REASONS else QUEUE_ORDER
    reason = blocked
    for req in waiting:
        t = req.times
        if req.grammar_pending:
            t.wait.set(GRAMMAR, at, t.waiting_since if t.waiting_since is not None else at)
        elif reason is not None:
            t.wait.set(reason, at, t.waiting_since if t.waiting_since is not None else at)
            reason = behind
