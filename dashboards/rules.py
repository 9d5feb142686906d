"""Prometheus rules from the SLO spec: SLI recording rules, burn-rate alerts, symptom alerts,
the CPU-cost recording rules (CPU seconds per output token) and the utilisation ones (the achieved fraction of
the machine's measured peak compute and bandwidth).

Recording rules follow `level:metric:operations` (level `job_model_name`: what `sum by`
keeps).  Each SLI aggregates numerator and denominator separately, then divides; an
errors SLI with no error series yet reads 0, not "no data".  Burn-rate alerts are the
SRE Workbook's multi-window pairs with no `for:`; page and ticket share an alert name
and differ by `severity`, so Alertmanager can inhibit the ticket twin of a page.

Every rule aggregates on purpose, at one of two scopes (`SCOPE` says which for each alert):

- service (`job, model_name`): the SLIs, the burn-rate alerts, load shedding and deadlines sum
  the counters of every instance (replica) first, so N replicas behind a load balancer make
  one alert for the service, with no `instance` label — what clients of the service see;
- instance (`job, instance`, plus the rank, process or component it concerns): an alert about
  one server — down, stalled, queue and KV of a rank, a late event loop, dropped or undecodable
  messages, engine restarts — fires per instance and names it in its summary.
"""

from __future__ import annotations

import re

from dashboards.slo import SLO, SLO_LEVEL, Spec

SERVICE = SLO_LEVEL  # ("job", "model_name"): the instances summed
INSTANCE = ("job", "instance")
BY = ", ".join(SERVICE)
LEVEL = "_".join(SLO_LEVEL)
RATIO = f"{LEVEL}:sightline_slo_errors:ratio_rate"  # + window, e.g. ..._rate5m
BUDGET_REMAINING = f"{LEVEL}:sightline_slo_error_budget_remaining:ratio"


def num(x: float) -> str:
    """A threshold as PromQL writes it: 0.0144, not 0.014400000000000001."""
    return f"{x:.6g}"


def ratio_name(window: str) -> str:
    return f"{RATIO}{window}"


def _sum_rate(metric: str, matchers: str, window: str) -> str:
    return f"sum by ({BY}) (rate({metric}{{{matchers}}}[{window}]))"


def sli_expr(slo: SLO, job: str, window: str) -> str:
    """Bad events ÷ all events over `window`, per job and model: every instance's events summed."""
    sel = f'job="{job}"'
    if slo.kind == "errors":
        total = _sum_rate(slo.metric, sel, window)
        bad = _sum_rate(slo.metric, f"{sel}, {slo.bad_matcher}", window)
        return f"(\n  {bad}\n  or 0 * {total}\n)\n/\n{total}"
    total = _sum_rate(f"{slo.metric}_count", sel, window)
    good = _sum_rate(f"{slo.metric}_bucket", f'{sel}, le="{slo.le}"', window)
    return f"(\n  {total}\n  -\n  {good}\n)\n/\n{total}"


def recording_rules(spec: Spec) -> list[dict]:
    rules = []
    for slo in spec.slos:
        for window in [*spec.windows(), spec.period]:
            rules.append(
                {"record": ratio_name(window), "expr": sli_expr(slo, spec.job, window), "labels": {"slo": slo.name}}
            )
        rules.append(
            {
                "record": BUDGET_REMAINING,
                "expr": f'1 - {ratio_name(spec.period)}{{slo="{slo.name}"}} / {num(slo.budget)}',
                "labels": {"slo": slo.name},
            }
        )
    return rules


def burn_condition(slo: SLO, severity: str, spec: Spec) -> str:
    """`(long > k·budget and short > k·budget) or ...` over the severity's window pairs."""
    pairs = []
    for w in spec.burn_rates[severity]:
        limit = num(w.factor * slo.budget)
        pairs.append(
            f'(\n  {ratio_name(w.long)}{{slo="{slo.name}"}} > {limit}\n'
            f'  and\n  {ratio_name(w.short)}{{slo="{slo.name}"}} > {limit}\n)'
        )
    return "\nor\n".join(pairs)


def burn_alerts(spec: Spec) -> list[dict]:
    alerts = []
    for slo in spec.slos:
        for severity, pairs in spec.burn_rates.items():
            windows = " or ".join(f"{w.long}/{w.short} at {num(w.factor)}x" for w in pairs)
            alerts.append(
                {
                    "alert": slo.alert,
                    "expr": burn_condition(slo, severity, spec),
                    "labels": {"severity": severity, "slo": slo.name},
                    "annotations": {
                        "summary": f"{{{{ $labels.model_name }}}}: {slo.name} SLO error budget is burning ({severity})",
                        "description": (
                            f"{slo.description} Objective {num(slo.objective * 100)} % over {spec.period}; "
                            f"the error ratio of job {{{{ $labels.job }}}}, all instances together, exceeds "
                            f"the burn rate over both windows of a pair ({windows}). Which replica: "
                            f"Overview → Which replica is bad?"
                        ),
                        "runbook_url": spec.runbook_url(slo.alert),
                    },
                }
            )
    return alerts


def new_failures_expr(job: str, window: str) -> str:
    """Engine failures in the last `window`, per process and cause.

    The server creates every `sightline_engine_failures_total{role, cause}` series at 0 when
    it starts, so `increase` sees the first failure too.
    """
    counter = f"sightline_engine_failures_total{{{job}}}[{window}]"
    return f"sum by (job, instance, role, cause) (increase({counter})) > 0"


# What each alert is about: "service" alerts sum every instance and carry no `instance` label
# (one alert for N replicas); "instance" alerts fire per instance and name it.
SCOPE = {
    "SightlineAvailabilityBudgetBurn": "service",
    "SightlineTTFTBudgetBurn": "service",
    "SightlineTPOTBudgetBurn": "service",
    "SightlineLoadShedding": "service",
    "SightlineRequestTimeouts": "service",
    "SightlineDown": "instance",
    "SightlineEngineStalled": "instance",
    "SightlineQueueBacklogGrowing": "instance",
    "SightlineQueueStuck": "instance",
    "SightlineKVCacheSaturated": "instance",
    "SightlineRetractionsSustained": "instance",
    "SightlineStaleDropSpike": "instance",
    "SightlineUndecodableMessages": "instance",
    "SightlineEngineRestarting": "instance",
    "SightlineEngineRecoverySlow": "instance",
    "SightlineEventLoopBlocked": "instance",
}


def symptom_alerts(spec: Spec) -> list[dict]:
    """Alerts on causes the SLOs only see later (down, stalled, backlog, KV, drops, bad frames, a
    late event loop) and on the reliability machinery at work (engine restarts, load shedding,
    deadlines).

    Engine gauges carry `dp_rank` (one series per Scheduler rank, also with one rank) and the
    TokenizerManager's in-flight gauge a `worker` label with several tokenizer workers: the
    backlog and KV alerts fire per rank, and the stall alert matches in-flight requests `on`
    the labels both sides share, so it fires once whichever worker holds them.  `SCOPE` says which
    alerts are about the service (instances summed) and which about one instance."""
    job, key, service = f'job="{spec.job}"', "job, instance, model_name", BY

    def p(alert: str, field: str = "threshold") -> str:
        value = spec.symptoms[alert][field]
        return num(value) if isinstance(value, (int, float)) else str(value)

    stall, backlog = p("SightlineEngineStalled"), p("SightlineQueueBacklogGrowing", "window")
    kv, drops = float(spec.symptoms["SightlineKVCacheSaturated"]["threshold"]), p("SightlineStaleDropSpike")
    retract, retract_w, retract_for = (p("SightlineRetractionsSustained", f) for f in ("threshold", "window", "for"))
    restart_w = p("SightlineEngineRestarting", "window")
    recovery, recovery_w = (
        float(spec.symptoms["SightlineEngineRecoverySlow"]["threshold"]),
        p("SightlineEngineRecoverySlow", "window"),
    )
    shed, shed_w, shed_for = (p("SightlineLoadShedding", f) for f in ("threshold", "window", "for"))
    slow, slow_w, slow_for = (p("SightlineRequestTimeouts", f) for f in ("threshold", "window", "for"))
    lag, lag_w, lag_for = (p("SightlineEventLoopBlocked", f) for f in ("threshold", "window", "for"))
    # (alert, severity, expr, summary, description)
    defs = [
        (
            "SightlineDown",
            "page",
            f"up{{{job}}} == 0",
            "{{ $labels.instance }} is down",
            "Prometheus cannot scrape {{ $labels.instance }} (job {{ $labels.job }}): the server is not answering "
            "/metrics.",
        ),
        (
            "SightlineEngineStalled",
            "page",
            f"sightline_seconds_since_last_token{{{job}}} > {stall}\nand on ({key})\n"
            f"sightline_requests_in_flight{{{job}}} > 0",
            "{{ $labels.instance }}: the engine has produced no token for a while",
            f"Requests are in flight but the Scheduler has sampled no token for more than {stall} s.",
        ),
        (
            "SightlineQueueBacklogGrowing",
            "ticket",
            f"sightline_num_requests_waiting{{{job}}} > {p('SightlineQueueBacklogGrowing')}\nand\n"
            f"deriv(sightline_num_requests_waiting{{{job}}}[{backlog}]) > 0",
            "{{ $labels.instance }} rank {{ $labels.dp_rank }}: the waiting queue keeps growing",
            f"Requests wait in the queue of Scheduler rank {{{{ $labels.dp_rank }}}} and the queue has grown over the "
            f"last {backlog}: arrivals outpace the engine (per rank: with --dp-size > 1 each rank has its queue).",
        ),
        (
            "SightlineQueueStuck",
            "page",
            f"sightline_queue_head_age_seconds{{{job}}} > {p('SightlineQueueStuck')}\nand\n"
            f"sightline_queue_head_fits{{{job}}} == 1",
            "{{ $labels.instance }} rank {{ $labels.dp_rank }}: the queue admits nothing though requests would fit",
            f"The oldest request waiting on Scheduler rank {{{{ $labels.dp_rank }}}} has waited more than "
            f"{p('SightlineQueueStuck')} s while the KV and batch room to admit it exist "
            "(sightline_queue_head_fits): admission is stuck, not saturated. Tokens of the running requests may "
            "still flow, so SightlineEngineStalled stays quiet; /health fails after --queue-stuck-timeout.",
        ),
        (
            "SightlineKVCacheSaturated",
            "ticket",
            f"sightline_kv_in_use_ratio{{{job}}} > {num(kv)}",
            "{{ $labels.instance }} rank {{ $labels.dp_rank }}: KV cache nearly full",
            f"Running requests hold more than {num(kv * 100)} % of the KV slots of Scheduler rank "
            "{{ $labels.dp_rank }} (evictable prefix cache counted free): new requests sent to that rank wait, and "
            "decode steps retract running ones when it is full (each rank has its own KV pool).",
        ),
        (
            "SightlineRetractionsSustained",
            "ticket",
            f"sum by (job, instance, model_name, dp_rank) (\n  rate(sightline_retractions_total{{{job}}}"
            f"[{retract_w}])\n) > {retract}",
            "{{ $labels.instance }} rank {{ $labels.dp_rank }}: requests keep being retracted",
            f"For {retract_for} Scheduler rank {{{{ $labels.dp_rank }}}} has retracted more than {retract} running "
            f"request/s (over {retract_w}): decode keeps running out of KV, so requests leave the batch, wait and "
            "resume (their inter-token latency jumps, and without the prefix cache their K/V is computed again). "
            "The admission estimate is too optimistic for this workload or the KV pool is too small.",
        ),
        (
            "SightlineStaleDropSpike",
            "ticket",
            f"sum by (job, instance, component, reason) (\n  rate(sightline_stale_messages_dropped_total{{{job}}}"
            f"[{p('SightlineStaleDropSpike', 'window')}])\n) > {drops}",
            "{{ $labels.instance }}: {{ $labels.component }} drops stale messages ({{ $labels.reason }})",
            f"More than {drops} message/s arrive for requests the {{{{ $labels.component }}}} no longer knows "
            "(reason {{ $labels.reason }}).",
        ),
        (
            "SightlineUndecodableMessages",
            "ticket",
            f"sum by (job, instance, component) (\n  increase(sightline_undecodable_messages_total{{{job}}}"
            f"[{p('SightlineUndecodableMessages', 'window')}])\n) > 0",
            "{{ $labels.instance }}: {{ $labels.component }} received undecodable frames",
            "{{ $labels.component }} received ZMQ frames that are not one of our message types: a foreign "
            "writer on the socket or mismatched versions.",
        ),
        (
            "SightlineEngineRestarting",
            "page",
            new_failures_expr(job, restart_w),
            "{{ $labels.instance }}: engine failure ({{ $labels.role }} {{ $labels.cause }}), "
            "requests in flight failed",
            f"In the last {restart_w} the watchdog saw the {{{{ $labels.role }}}} process fail (cause "
            "{{ $labels.cause }}: exited = the process died, stalled = no heartbeat for --watchdog-timeout with "
            "requests in flight). Every request in flight ended with 503 and both engine processes were replaced "
            "while HTTP stayed up; sightline_engine_restarts_total counts the restarts that succeeded (a failed "
            "restart stops the server: SightlineDown).",
        ),
        (
            "SightlineEngineRecoverySlow",
            "ticket",
            f"sum by (job, instance) (increase(sightline_engine_recovery_seconds_count{{{job}}}[{recovery_w}]))\n> "
            f"sum by (job, instance) (increase(sightline_engine_recovery_seconds_bucket{{{job}, "
            f'le="{recovery!r}"}}[{recovery_w}]))',
            "{{ $labels.instance }}: the engine took longer than its budget to recover",
            f"In the last {recovery_w} a recovery from an engine failure (failure seen → every replacement child "
            f"ready) took more than {num(recovery)} s, while requests got 503. sightline_startup_phase_seconds says "
            "which phase of the new children's start was slow (weight_load: the disk or the model cache; imports: a "
            "cold page cache; model_resolve: a GGUF conversion redone); the log's `engine restarted in` line "
            "gives the backoff and the failed attempts in between.",
        ),
        (
            "SightlineLoadShedding",
            "ticket",
            f"sum by ({service}, reason) (\n  rate(sightline_requests_shed_total{{{job}}}[{shed_w}])\n) > {shed}",
            "{{ $labels.model_name }} requests are refused with 429 ({{ $labels.reason }})",
            f"For {shed_for} overload protection has refused more than {shed} request/s (over {shed_w}, all instances "
            "of job {{ $labels.job }} together) with 429 + Retry-After, reason {{ $labels.reason }} (queue_full: "
            "--max-queued-requests requests wait for their first token; tokens_full: the KV tokens the in-flight "
            "requests are expected to need reached --max-inflight-tokens). Demand exceeds capacity; Overview → "
            "Which replica is bad? shows whether one instance sheds or all do.",
        ),
        (
            "SightlineRequestTimeouts",
            "ticket",
            f'sum by ({service}) (\n  rate(sightline_request_aborts_total{{{job}, reason="timeout"}}'
            f"[{slow_w}])\n) > {slow}",
            "{{ $labels.model_name }} requests time out (504)",
            f"For {slow_for} more than {slow} request/s (over {slow_w}, all instances of job {{{{ $labels.job }}}} "
            "together) ended with 504 because a deadline passed: --request-timeout or the client's "
            "x-request-timeout header, or --max-queue-time in the Scheduler's queue.",
        ),
        (
            "SightlineEventLoopBlocked",
            "ticket",
            f"histogram_quantile(0.99,\n  sum by (job, instance, role, le) (\n"
            f"    rate(sightline_event_loop_lag_seconds_bucket{{{job}}}[{lag_w}])\n  )\n) > {lag}",
            "{{ $labels.instance }} {{ $labels.role }}: the TokenizerManager event loop runs late",
            f"For {lag_for} the p99 event-loop lag of front-end process {{{{ $labels.role }}}} (main, or worker-N "
            f"with --tokenizer-worker-num) has been above {lag} s over {lag_w}: something holds its event loop "
            "(tokenizing a huge prompt inline, parsing a huge JSON body, a blocking call, GC pauses) and every "
            "request that process serves waits as long — ITL and TTFT spikes the engine does not explain.",
        ),
    ]
    alerts = []
    for name, severity, expr, summary, description in defs:
        rule = {"alert": name, "expr": expr}
        if p(name, "for") not in ("0s", "0"):
            rule["for"] = p(name, "for")
        rule["labels"] = {"severity": severity}
        rule["annotations"] = {"summary": summary, "description": description, "runbook_url": spec.runbook_url(name)}
        alerts.append(rule)
    return alerts


COST_WINDOW = "5m"
CPU_PER_TOKEN = "sightline_cpu_seconds_per_output_token"
CPU_PER_TOKEN_BY_ROLE = f"job_role:{CPU_PER_TOKEN}:rate{COST_WINDOW}"
CPU_PER_TOKEN_TOTAL = f"job:{CPU_PER_TOKEN}:rate{COST_WINDOW}"


def cost_rules(spec: Spec) -> list[dict]:
    """CPU seconds per output token, per process role and in total (docs/runbook.md prices it).

    CPU (`sightline_process_cpu_seconds_total{role}`) has no model label: with one model per
    server, every output token of the job is the denominator.  No series while nothing is
    generated (the denominator is kept only above 0), rather than +Inf."""
    job, w = f'job="{spec.job}"', COST_WINDOW
    tokens = f"(\n  sum by (job) (rate(sightline_generation_tokens_total{{{job}}}[{w}])) > 0\n)"
    return [
        {
            "record": CPU_PER_TOKEN_BY_ROLE,
            "expr": f"sum by (job, role) (rate(sightline_process_cpu_seconds_total{{{job}}}[{w}]))\n"
            f"/ on (job) group_left ()\n{tokens}",
        },
        # the group runs in order: this reads the per-role series of this evaluation
        {"record": CPU_PER_TOKEN_TOTAL, "expr": f"sum by (job) ({CPU_PER_TOKEN_BY_ROLE})"},
    ]


PEAK_FRACTION = {
    kind: f"job_instance_rank:sightline_engine_peak_{kind}_fraction:rate{COST_WINDOW}" for kind in ("flops", "bytes")
}
# what each fraction divides: the steps' counted work, the machine's measured peak
PEAK_PAIRS = {
    "flops": ("sightline_engine_flops_total", "sightline_machine_peak_flops"),
    "bytes": ("sightline_engine_bytes_total", "sightline_machine_peak_bytes_per_second"),
}


def utilisation_rules(spec: Spec) -> list[dict]:
    """The achieved fraction of the machine's peak compute and bandwidth, per Scheduler rank of each instance:
    the steps' analytic FLOPs and bytes per second ÷ what the rank measured at its start. No series without
    a measured peak (--no-peak-probe), rather than +Inf."""
    job, w, by = f'job="{spec.job}"', COST_WINDOW, "job, instance, dp_rank"
    return [
        {
            "record": PEAK_FRACTION[kind],
            "expr": f"sum by ({by}) (rate({work}{{{job}}}[{w}]))\n/ on ({by})\n(max by ({by}) ({peak}{{{job}}}) > 0)",
        }
        for kind, (work, peak) in PEAK_PAIRS.items()
    ]


def rule_files(spec: Spec) -> dict[str, dict]:
    """File name (under prometheus/rules/) → rule file content."""
    return {
        # one group: its rules run in order, so the alerts read this evaluation's ratios
        "slo.yml": {"groups": [{"name": "sightline-slo", "rules": recording_rules(spec) + burn_alerts(spec)}]},
        "symptoms.yml": {"groups": [{"name": "sightline-symptoms", "rules": symptom_alerts(spec)}]},
        "cost.yml": {"groups": [{"name": "sightline-cost", "rules": cost_rules(spec)}]},
        "utilisation.yml": {"groups": [{"name": "sightline-utilisation", "rules": utilisation_rules(spec)}]},
    }


def render(template: str, labels: dict[str, str]) -> str:
    """Expand `{{ $labels.x }}` as Prometheus would (all our annotations use only that)."""
    out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)
    if "{{" in out:
        raise ValueError(f"template uses more than $labels: {template!r}")
    return out
