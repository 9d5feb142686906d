"""The Tenants row of the overview board: who uses the server, how much, and who is held back."""

from __future__ import annotations

from dashboards import promql as q
from dashboards.panels import timeseries_panel

TENANT = ("tenant",)


def tenant_panels() -> list:
    return [
        timeseries_panel(
            "Requests by tenant",
            "Generation requests ending per second, by tenant (sightline_tenant_requests_total; the "
            "tenant is the one the API key names, `other` past --max-tenant-labels, `default` "
            "without a keys file). Stacked, it is the request rate of Requests by outcome.",
            "reqps",
            [(q.rate("sightline_tenant_requests_total", by=TENANT), "{{tenant}}")],
            stack=True,
        ),
        timeseries_panel(
            "Tokens by tenant",
            "Prompt and output tokens of ended requests per second, by tenant, and the prompt tokens "
            "each reused from its own prefix-cache namespace (cached).",
            "suffix: tokens/s",
            [
                (q.rate("sightline_tenant_prompt_tokens_total", by=TENANT), "{{tenant}} prompt"),
                (q.rate("sightline_tenant_cached_tokens_total", by=TENANT), "{{tenant}} cached"),
                (q.rate("sightline_tenant_generation_tokens_total", by=TENANT), "{{tenant}} output"),
            ],
        ),
        timeseries_panel(
            "Engine CPU by tenant",
            "Engine CPU seconds per second each tenant's ended requests used: every engine step's "
            "CPU time split between its requests by the tokens it fed each "
            "(sightline_tenant_cpu_seconds_total).",
            "short",
            [(q.rate("sightline_tenant_cpu_seconds_total", by=TENANT), "{{tenant}}")],
            stack=True,
        ),
        timeseries_panel(
            "Refused at a tenant's limit",
            "Requests answered 429 per second because their tenant was at its limit "
            "(sightline_tenant_requests_total outcome shed, by tenant; the server-wide 429s are "
            "there too) and, over all tenants, by limit (sightline_requests_shed_total: "
            "tenant_concurrency, tenant_tokens).",
            "reqps",
            [
                (q.rate("sightline_tenant_requests_total", 'outcome="shed"', by=TENANT), "{{tenant}}"),
                (q.rate("sightline_requests_shed_total", 'reason=~"tenant_.*"', by=("reason",)), "{{reason}}"),
            ],
        ),
    ]
