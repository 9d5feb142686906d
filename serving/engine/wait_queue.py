"""The Scheduler's waiting queue: higher priority first, arrival order within a priority.

This is the engine's priority: the front end turns the API's `priority` (vLLM's reading by
default, lower sooner: `serving/frontend/tenants/priority.py`) and its tenant's into one
number where higher runs first, never more urgent than the tenant's.  Admission takes the
head of this queue strictly in order (no overtaking by a smaller request of the same
priority), so a higher-priority request arriving while a lower one waits for KV goes ahead
of it; one already running is never displaced, only retracted last
(`AdmissionPolicy.victims`: lowest priority first).  A retracted request goes back ahead of
the waiting requests of its own priority (it holds pinned cache), behind those of a higher
one.  Nothing ages: a steady stream from a higher-priority tenant can keep a lower one
waiting, bounded by that tenant's own limits (`max_concurrent_requests`,
`tokens_per_minute`) and by `--max-queue-time`.  With every priority equal (no keys file)
it is the plain FCFS deque.
"""

from __future__ import annotations

from collections import deque

from serving.engine.request import Req


class WaitQueue(deque):
    def append(self, req: Req) -> None:
        """A new arrival: behind every request of its priority or higher."""
        i = len(self)
        while i > 0 and self[i - 1].priority < req.priority:
            i -= 1
        self.insert(i, req)

    def appendleft(self, req: Req) -> None:
        """A retracted request: ahead of every request of its priority or lower."""
        i = 0
        while i < len(self) and self[i].priority > req.priority:
            i += 1
        self.insert(i, req)
