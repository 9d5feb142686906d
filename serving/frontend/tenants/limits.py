"""Per-tenant limits: concurrent requests and a token rate, decided in one place for the whole server.

One `TenantLimiter` holds every tenant's counts: the single front end's, or, with several
tokenizer workers, the hub's (each worker asks it for every request of a limited tenant:
`gate.HubGate`), so a limit holds over all workers instead of N times over.  A lease is
one admitted request, keyed by (worker, rid); a worker that dies has its leases dropped.

The token rate is a bucket of `tokens_per_minute` tokens refilled at that rate (so a
minute's worth may come at once).  A request is charged its prompt tokens (every one,
cached or not: what was cached must not change the bill) when it is admitted, and its
output tokens when it ends; admission needs the bucket to hold its prompt (at most the
bucket's size), so a tenant whose outputs ran the bucket into debt waits until it is
paid.  A refusal says which limit, the tenant's own numbers and when to retry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from serving.frontend.tenants.keys import TenantPolicy
from telemetry.clock import now_ns

CONCURRENCY, TOKENS = "concurrency", "tokens"


@dataclass
class Refusal:
    limit: str  # concurrency | tokens
    message: str
    retry_after: int  # seconds


@dataclass
class _Bucket:
    level: float
    at: int  # monotonic ns of `level`


class TenantLimiter:
    def __init__(self, policy: Callable[[str], TenantPolicy], clock: Callable[[], int] = now_ns) -> None:
        self.policy = policy  # the keys in force (reloads apply to the next request)
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self.buckets: dict[str, _Bucket] = {}
        self.leases: dict[tuple[int, str], str] = {}  # (worker, rid) -> tenant

    def _bucket(self, tenant: str, rate: int) -> _Bucket:
        now = self.clock()
        b = self.buckets.get(tenant)
        if b is None:
            b = self.buckets[tenant] = _Bucket(float(rate), now)
        b.level = min(float(rate), b.level + rate * (now - b.at) / 60e9)
        b.at = now
        return b

    def acquire(self, tenant: str, lease: tuple[int, str], prompt_tokens: int) -> Refusal | None:
        """Admit one request of `tenant` (held until `release`), or say why not."""
        p = self.policy(tenant)
        running = self.in_flight.get(tenant, 0)
        if p.max_concurrent_requests is not None and running >= p.max_concurrent_requests:
            return Refusal(
                CONCURRENCY,
                f"tenant {tenant!r} has {running} requests in flight, its limit is {p.max_concurrent_requests}",
                1,
            )
        if p.tokens_per_minute is not None:
            b = self._bucket(tenant, p.tokens_per_minute)
            need = min(prompt_tokens, p.tokens_per_minute)
            if b.level < need:
                wait = (need - b.level) * 60 / p.tokens_per_minute
                return Refusal(
                    TOKENS,
                    f"tenant {tenant!r} is over its {p.tokens_per_minute} tokens per minute: "
                    f"{max(0, int(b.level))} tokens left, this prompt needs {prompt_tokens}",
                    max(1, min(60, math.ceil(wait))),
                )
            b.level -= prompt_tokens
        self.in_flight[tenant] = running + 1
        self.leases[lease] = tenant
        return None

    def release(self, lease: tuple[int, str], output_tokens: int) -> None:
        """The request ended: it leaves the tenant's count and pays for its output."""
        tenant = self.leases.pop(lease, None)
        if tenant is None:
            return
        self.in_flight[tenant] -= 1
        rate = self.policy(tenant).tokens_per_minute
        if rate is not None and output_tokens:
            self._bucket(tenant, rate).level -= output_tokens

    def drop_worker(self, worker: int) -> int:
        """A tokenizer worker died: its requests died with it."""
        gone = [lease for lease in self.leases if lease[0] == worker]
        for lease in gone:
            self.release(lease, 0)
        return len(gone)

    def snapshot(self) -> Mapping[str, dict]:
        return {
            t: {"in_flight": n, **({"tokens_left": int(self.buckets[t].level)} if t in self.buckets else {})}
            for t, n in sorted(self.in_flight.items())
        }
