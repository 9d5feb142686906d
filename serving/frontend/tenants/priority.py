"""A request's engine priority from its tenant's and its own `priority` (`--priority-order`).

The Scheduler always serves a higher engine priority first (`serving/engine/wait_queue.py`,
retraction victims lowest first).  The API reads `priority` the way vLLM does by default
(`lower-first`: a lower value is served sooner), so the front end hands the engine the
negated value; `higher-first` keeps sightline's earlier reading for deployments whose
tenants file was written for it.  Either way a request can never claim better than its
tenant's: its value is clamped to the tenant's before the conversion.
"""

from __future__ import annotations

ORDERS = ("lower-first", "higher-first")


def engine_priority(order: str, tenant: int, requested: int | None) -> int:
    """The priority the Scheduler sorts by (higher first) for a request of a tenant."""
    if order == "higher-first":
        return tenant if requested is None else min(tenant, requested)
    return -(tenant if requested is None else max(tenant, requested))
