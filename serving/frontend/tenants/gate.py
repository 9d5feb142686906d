"""Where a TokenizerManager asks for a tenant's limits: its own `TenantLimiter` (one front end) or the
hub's (several tokenizer workers: one round trip for each request of a limited tenant, none for others).

A refusal becomes the 429 the client sees: `overloaded_error` with code `tenant_concurrency`
or `tenant_tokens`, the tenant's own numbers in the message and a `Retry-After`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Protocol

from protocol.io_struct import HubQuery
from serving.frontend.errors import APIError
from serving.frontend.tenants.keys import TenantPolicy
from serving.frontend.tenants.limits import Refusal, TenantLimiter


def refused(r: Refusal) -> APIError:
    return APIError(
        429,
        f"{r.message}; retry after {r.retry_after} s",
        type="overloaded_error",
        code=f"tenant_{r.limit}",
        headers={"retry-after": str(r.retry_after)},
    )


class TenantGate(Protocol):
    async def acquire(self, tenant: str, rid: str, prompt_tokens: int) -> Refusal | None: ...

    def release(self, tenant: str, rid: str, output_tokens: int) -> None: ...


class LocalGate:
    """One front end: the limiter is here."""

    def __init__(self, policy: Callable[[str], TenantPolicy]) -> None:
        self.limiter = TenantLimiter(policy)

    async def acquire(self, tenant: str, rid: str, prompt_tokens: int) -> Refusal | None:
        return self.limiter.acquire(tenant, (0, rid), prompt_tokens)

    def release(self, tenant: str, rid: str, output_tokens: int) -> None:
        self.limiter.release((0, rid), output_tokens)


class HubGate:
    """A tokenizer worker: the hub's limiter decides (`Hub.tenant_query`); unlimited tenants skip the trip."""

    def __init__(self, link: Any, policy: Callable[[str], TenantPolicy]) -> None:
        self.link = link  # the worker's HubLink: `query`, `send`, `worker`
        self.policy = policy
        self.held: set[str] = set()  # rids holding a lease at the hub

    async def acquire(self, tenant: str, rid: str, prompt_tokens: int) -> Refusal | None:
        if not self.policy(tenant).limited:
            return None
        reply = await self.link.query(
            "tenant_acquire", json.dumps({"tenant": tenant, "rid": rid, "prompt_tokens": prompt_tokens})
        )
        if reply.status == 200:
            self.held.add(rid)
            return None
        return Refusal(**json.loads(reply.body))

    def release(self, tenant: str, rid: str, output_tokens: int) -> None:
        if rid in self.held:
            self.held.discard(rid)
            self.link.send(
                HubQuery(
                    id="",
                    worker=self.link.worker,
                    kind="tenant_release",
                    arg=json.dumps({"rid": rid, "output_tokens": output_tokens}),
                )
            )
