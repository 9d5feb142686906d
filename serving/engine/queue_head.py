"""The head of a Scheduler rank's waiting queue: how long the oldest waiting request has waited, and
whether the request admission takes next would fit now.

A queue whose head ages while it would fit is the shape of an engine that admits nothing while the
running requests still trickle tokens (the stall check, which needs no token at all, misses it):
`/health` degrades and `SightlineQueueStuck` fires on it (`--queue-stuck-timeout`).  Waiting for
KV or for the running limit is saturation, not a fault, so `fits` is False then; and False while
the rank is paused (nothing is admitted on purpose).  A request whose grammar still compiles is
neither the head nor the oldest: admission passes over it until then.
"""

from __future__ import annotations

from serving.engine.scheduler_core import SchedulerCore


def queue_head(core: SchedulerCore, now: int, paused: bool = False) -> dict[str, float | bool]:
    """Its part of `SchedulerStats`, by field name: `queue_head_age_seconds` (0 with nothing waiting)
    and `queue_head_fits` (the next request to admit has the KV and the batch room it needs)."""
    ready = [r for r in core.waiting if not r.grammar_pending]
    if not ready:
        return {"queue_head_age_seconds": 0.0, "queue_head_fits": False}
    since = min(r.times.waiting_since or r.times.queued or now for r in ready)
    fits = (
        not paused
        and core.num_running < core.args.max_running_requests
        and core.policy.committed(core.running) + core.policy.need(ready[0]) <= core.cache.available
    )
    return {"queue_head_age_seconds": max(0.0, (now - since) / 1e9), "queue_head_fits": fits}
