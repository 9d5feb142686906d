"""SLOs: attainment, error budget left, burn rate per window and alert state, per SLO; and
server-side goodput, judged per request against its own objectives.

The SLO rows read the recording rules generated from the same spec (dashboards/slo.yaml), so
the board and the alerts can never disagree on what an SLO is.  The goodput row reads
`sightline_request_slo_total` (telemetry/request_slo.py): each request's objectives come from
its headers or its tenant, not from the spec.
"""

from __future__ import annotations

from dashboards import promql as q
from dashboards import slo as spec_mod
from dashboards.panels import Board, stat_panel, timeseries_panel
from dashboards.rules import BUDGET_REMAINING, num, ratio_name


def _m(slo: str) -> str:
    return f'{{slo="{slo}", job=~"$job", model_name=~"$model_name"}}'


def board() -> Board:
    spec = spec_mod.load()
    b = Board(
        "sightline-slo",
        "Sightline / SLOs",
        f"Service level objectives over {spec.period}: attainment, error budget, burn rates, alerts. "
        "SLO series are aggregated per job and model (the instance variable does not apply).",
    )
    pairs = "; ".join(
        f"{sev} at " + " or ".join(f"{num(w.factor)} ({w.long} & {w.short})" for w in ws)
        for sev, ws in spec.burn_rates.items()
    )
    for slo in spec.slos:
        period = ratio_name(spec.period)
        b.row(
            f"{slo.name} — objective {num(slo.objective * 100)} %",
            stat_panel(
                f"{slo.name}: attainment",
                f"{slo.description} Share of good events over the last {spec.period} "
                f"(objective {num(slo.objective * 100)} %).",
                "percentunit",
                [(f"1 - {period}{_m(slo.name)}", "{{model_name}}")],
                decimals=4,
            ),
            stat_panel(
                f"{slo.name}: error budget remaining",
                f"Share of the {spec.period} error budget "
                f"({num(slo.budget * 100)} % of events) not yet spent; below 0 the SLO is missed.",
                "percentunit",
                [(f"{BUDGET_REMAINING}{_m(slo.name)}", "{{model_name}}")],
                decimals=2,
            ),
            timeseries_panel(
                f"{slo.name}: burn rate per window",
                "Error ratio ÷ budget over each alert window: "
                f"1 spends the budget exactly in {spec.period}. Alerts: {pairs}.",
                "suffix:×",
                [
                    (f"{ratio_name(w)}{_m(slo.name)} / {num(slo.budget)}", f"{w} {{{{model_name}}}}")
                    for w in spec.windows()
                ],
            ),
        )
    b.row("Server-side goodput (per-request objectives)", *goodput_panels())
    b.row(
        "Alerts",
        timeseries_panel(
            "Alert state",
            "Sightline alerts pending or firing (Prometheus' ALERTS series), by alert, "
            "severity and state: the number of alerts, so a per-instance alert (SightlineDown...) "
            "counts once per instance it names, a service-level one (burn rates) once. Page alerts "
            "inhibit their ticket twins in Alertmanager.",
            "short",
            [
                (
                    'sum by (alertname, severity, alertstate) (ALERTS{alertname=~"Sightline.*", job=~"$job"})',
                    "{{alertname}} {{severity}} {{alertstate}}",
                )
            ],
            width=24,
        ),
    )
    return b


SLO_TOTAL = "sightline_request_slo_total"
MET, BY_SLO = 'met="true"', ("slo",)


def goodput_panels() -> list:
    """Requests that met every objective they carried, and which objectives the rest missed: the
    server's count of what a load generator's goodput search measures from outside."""
    return [
        timeseries_panel(
            "Goodput: requests meeting all their objectives",
            "Requests per second that succeeded within every latency objective they carried (x-llm-d-slo-ttft-ms, "
            "x-llm-d-slo-tpot-ms, x-sightline-slo-e2e-ms, else their tenant's slo_*_ms), beside every request "
            "that carried one. The server's own goodput: compare it with the client-side goodput search of "
            "`make loadtest` (docs/loadtest.md) — a gap is time spent outside the server (network, proxies). "
            "Requests without objectives are in neither line.",
            "reqps",
            [(q.rate(SLO_TOTAL, 'slo="all"', MET), "goodput"), (q.rate(SLO_TOTAL, 'slo="all"'), "with objectives")],
        ),
        timeseries_panel(
            "Share meeting each objective",
            "Of the requests judged against an objective, the share that met it, by objective (ttft, tpot, e2e) "
            "and for all of a request's objectives at once (all). A failed, aborted or refused request meets "
            "none; TPOT is not judged for a successful one-token answer. The traces of the requests that missed "
            "are kept (tail sampling reason slo).",
            "percentunit",
            [(q.rate(SLO_TOTAL, MET, by=BY_SLO) + "\n/\n" + q.rate(SLO_TOTAL, by=BY_SLO), "{{slo}}")],
        ),
    ]
