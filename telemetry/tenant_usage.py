"""Per-tenant usage in Prometheus, with a bounded `tenant` label.

The label takes the keys file's tenants, at most `--max-tenant-labels` of them (in name
order); any other tenant (one past the cap, one a reload removed while its requests ran)
is counted as `other`.  A server without a keys file has one tenant, `default`.
Every count is taken where the all-tenant total is (`RequestTelemetry.finish` and
`rejected`), from the same numbers, so summing over `tenant` gives the total exactly:
requests (by outcome) = `sightline_requests_total`, prompt and output tokens =
`sightline_prompt_tokens_total` and `sightline_generation_tokens_total`; cached tokens sum
to the requests' `usage.prompt_tokens_details.cached_tokens`; CPU-seconds are each
request's share of the engine steps it was in (`serving/engine/cpu_share.py`).  Latency
objectives met and missed (`sightline_request_slo_total`) are counted per tenant too.
"""

from __future__ import annotations

from telemetry.metrics import Metrics
from telemetry.outcomes import OUTCOMES
from telemetry.request_slo import SLO_LABELS

OTHER = "other"


class TenantUsage:
    def __init__(self, metrics: Metrics | None) -> None:
        self.m = metrics
        self.known: frozenset[str] = frozenset()

    def set_tenants(self, tenants: list[str], cap: int) -> None:
        """The label values from now on; each one's series exist at 0 at once (increase() sees the first)."""
        self.known = frozenset(sorted(tenants)[:cap])
        if self.m is None:
            return
        for t in sorted(self.known) + [OTHER]:
            for outcome in OUTCOMES:
                self.m.tenant_requests.labels(t, outcome)
            for slo in SLO_LABELS:
                for met in ("true", "false"):
                    self.m.request_slo.labels(slo, met, t)
            for c in (
                self.m.tenant_prompt_tokens,
                self.m.tenant_cached_tokens,
                self.m.tenant_generation_tokens,
                self.m.tenant_cpu,
            ):
                c.labels(t)

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.known else OTHER

    def request(self, tenant: str, outcome: str) -> None:
        if self.m is not None:
            self.m.tenant_requests.labels(self.label(tenant), outcome).inc()

    def usage(self, tenant: str, prompt: int, cached: int, output: int, cpu_ns: int) -> None:
        if self.m is None:
            return
        t = self.label(tenant)
        self.m.tenant_prompt_tokens.labels(t).inc(prompt)
        self.m.tenant_cached_tokens.labels(t).inc(cached)
        self.m.tenant_generation_tokens.labels(t).inc(output)
        self.m.tenant_cpu.labels(t).inc(cpu_ns / 1e9)

    def slo(self, tenant: str, met: dict[str, bool]) -> None:
        """One request's objectives, judged (telemetry.request_slo.judge)."""
        if self.m is None:
            return
        t = self.label(tenant)
        for slo, ok in met.items():
            self.m.request_slo.labels(slo, "true" if ok else "false", t).inc()
