"""promtool unit tests for every alert, built from scenarios written as error budgets.

Each burn-rate scenario is a list of phases (minutes, burn rate: 1 = spending the
budget exactly over the SLO period) turned into counter series, and the severities
that must fire at the end.  The expectations are the SRE Workbook's arithmetic done by
hand (see the comments), not read back from the rules, so a wrong factor, window or
`and`/`or` in the generated rules fails `promtool test rules`.
"""

from __future__ import annotations

from dashboards.promql import has_model_label
from dashboards.rules import (
    BUDGET_REMAINING,
    CPU_PER_TOKEN_BY_ROLE,
    CPU_PER_TOKEN_TOTAL,
    PEAK_FRACTION,
    burn_alerts,
    render,
    symptom_alerts,
)
from dashboards.slo import SLO, Spec
from telemetry.buckets import DEFAULT_BUCKETS

RATE = 1000  # requests per minute in every scenario
BASE = {"job": "sightline", "instance": "sightline:8000", "model_name": "m"}

# name: (phases [(minutes, burn rate)], severities firing at the end)
BURN_SCENARIOS: dict[str, tuple[list[tuple[int, float]], list[str]]] = {
    # burn 0.5 for longer than the longest short window: half the budget rate, nothing fires
    "healthy": ([(400, 0.5)], []),
    # burn 20 > 14.4 on 1h & 5m: page (and the ticket twin, which Alertmanager inhibits)
    "fast burn": ([(20, 20)], ["page", "ticket"]),
    # burn 40 for 25 min, clean for 30, burn 20 for the last 5: 1h reads 18.3 and 5m 20,
    # both > 14.4, while 30m reads 3.3 < 6: only the 1h pair pages
    "1h page pair": ([(25, 40), (30, 0), (5, 20)], ["page", "ticket"]),
    # the same with 25 at first: 1h reads 12.1 < 14.4, so no page (2h reads 12.1 > 3: ticket)
    "1h pair under its factor": ([(25, 25), (30, 0), (5, 20)], ["ticket"]),
    # burn 10: below 14.4 but above 6 on 6h & 30m: the slower page pair
    "6h page pair": ([(60, 10)], ["page", "ticket"]),
    # burn 4: above 3 on 1d & 2h, below every page factor.  (Whenever the 1d pair fires the
    # 3d pair does too — 6h >= 2h/3 > 1 — so no series isolates the 1d pair's factor.)
    "1d ticket pair": ([(180, 4)], ["ticket"]),
    # burn 2 for more than 6 h: above 1 on 3d & 6h only
    "3d ticket pair": ([(370, 2)], ["ticket"]),
    # burn 20 for 1 h, then clean for 40 min: the 6h window still reads 12 > 6 but the
    # 30m window is clean, so the page resolves; the 2h window (12 > 3) keeps the ticket
    "recovered": ([(60, 20), (40, 0)], ["ticket"]),
    # 3 h clean, then burn 60 for 2 min: the 5m window reads 24 > 14.4, the 1h window 2:
    # a blip pages nobody
    "blip": ([(178, 0), (2, 60)], []),
}


def _counter(phases: list[tuple[int, float]], per_minute) -> str:
    """promtool's expanding notation for a counter growing per phase."""
    parts, value = [], 0.0
    for i, (minutes, burn) in enumerate(phases):
        step = per_minute(burn)
        start = value if i == 0 else value + step
        count = minutes if i == 0 else minutes - 1
        parts.append(f"{start:g}+{step:g}x{count}")
        value = start + step * count
    return " ".join(parts)


# Several instances (replicas) of one service, each serving RATE: (instance → phases, severities).
# The SLIs sum the instances before dividing, so the alert reads the service's burn rate and
# fires once, with no `instance` label.
MULTI_INSTANCE_SCENARIOS: dict[str, tuple[dict[str, list[tuple[int, float]]], list[str]]] = {
    # burn 10 and 20 on two instances: the service burns 15 > 14.4 on 1h & 5m — one page (and
    # one ticket twin), where per-instance rules would page twice
    "two instances, each with errors": ({"a:8000": [(60, 10)], "b:8000": [(60, 20)]}, ["page", "ticket"]),
    # one instance of three burns 15 for 20 min (> 14.4: it alone would page), the others are
    # clean: the service burns 5 — under both page factors (14.4, 6), over the ticket's 3
    "one bad instance of three": ({"a:8000": [(20, 15)], "b:8000": [(20, 0)], "c:8000": [(20, 0)]}, ["ticket"]),
}


def _burn_series(slo: SLO, phases: list[tuple[int, float]], instance: str = BASE["instance"]) -> list[dict]:
    bad = lambda burn: RATE * slo.budget * burn  # noqa: E731
    labels = ",".join(f'{k}="{v}"' for k, v in {**BASE, "instance": instance}.items())
    if slo.kind == "errors":
        good_s = f'{slo.metric}{{{labels},finish_reason="stop",status="200"}}'
        bad_s = f'{slo.metric}{{{labels},finish_reason="error",status="500"}}'
        return [
            {"series": good_s, "values": _counter(phases, lambda b: RATE - bad(b))},
            {"series": bad_s, "values": _counter(phases, bad)},
        ]
    return [
        {"series": f"{slo.metric}_count{{{labels}}}", "values": _counter(phases, lambda b: RATE)},
        {
            "series": f'{slo.metric}_bucket{{{labels},le="{slo.le}"}}',
            "values": _counter(phases, lambda b: RATE - bad(b)),
        },
    ]


def _expected(rules: list[dict], name: str, extra: dict[str, str], severities: list[str]) -> list[dict]:
    out = []
    for rule in rules:
        sev = rule["labels"]["severity"]
        if rule["alert"] != name or sev not in severities:
            continue
        if any(rule["labels"].get(k, v) != v for k, v in extra.items()):
            continue
        labels = {**extra, **rule["labels"]}
        out.append(
            {"exp_labels": labels, "exp_annotations": {k: render(v, labels) for k, v in rule["annotations"].items()}}
        )
    return out


def slo_tests(spec: Spec) -> dict:
    alerts = burn_alerts(spec)
    level = {k: BASE[k] for k in ("job", "model_name")}
    tests = []
    for slo in spec.slos:
        for scenario, (phases, severities) in BURN_SCENARIOS.items():
            end = sum(m for m, _ in phases)
            test = {
                "name": f"{slo.name}: {scenario}",
                "interval": "1m",
                "input_series": _burn_series(slo, phases),
                "alert_rule_test": [
                    {
                        "eval_time": f"{end}m",
                        "alertname": slo.alert,
                        "exp_alerts": _expected(alerts, slo.alert, {**level, "slo": slo.name}, severities),
                    }
                ],
            }
            if scenario == "healthy":  # burn 0.5 all along: half the budget is left
                remaining = f'{BUDGET_REMAINING}{{slo="{slo.name}"}}'
                test["promql_expr_test"] = [
                    {
                        "expr": f"({remaining} > bool 0.49) * ({remaining} < bool 0.51)",
                        "eval_time": f"{end}m",
                        "exp_samples": [{"labels": _series_labels({**level, "slo": slo.name}), "value": 1}],
                    }
                ]
            tests.append(test)
        for scenario, (instances, severities) in MULTI_INSTANCE_SCENARIOS.items():
            end = max(sum(m for m, _ in phases) for phases in instances.values())
            series = [s for inst, phases in instances.items() for s in _burn_series(slo, phases, inst)]
            # exp_labels are the whole label set: an `instance` label, or one alert per instance, fails
            tests.append(
                {
                    "name": f"{slo.name}: {scenario}",
                    "interval": "1m",
                    "input_series": series,
                    "alert_rule_test": [
                        {
                            "eval_time": f"{end}m",
                            "alertname": slo.alert,
                            "exp_alerts": _expected(alerts, slo.alert, {**level, "slo": slo.name}, severities),
                        }
                    ],
                }
            )
    # every eval_time is a multiple of 5 min; rates still read the 1-minute samples
    return {"rule_files": ["../rules/slo.yml"], "evaluation_interval": "5m", "tests": tests}


def _series_labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _s(name: str, values: str, **labels: str) -> dict:
    """An input series with BASE's labels; model_name only where the metric has it."""
    all_labels = {**BASE, **labels}
    if not has_model_label(name):
        all_labels.pop("model_name")
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in all_labels.items()) + "}", "values": values}


def _lag(per_minute: dict[str, float], minutes: int = 30, **labels: str) -> list[dict]:
    """Event-loop lag histogram series: `per_minute` maps each bucket bound to the samples per
    minute at most that late (cumulative, as Prometheus buckets are); +Inf is the count."""
    name = "sightline_event_loop_lag_seconds"
    out = [_s(f"{name}_bucket", f"0+{n:g}x{minutes}", le=le, **labels) for le, n in per_minute.items()]
    return out + [_s(f"{name}_count", f"0+{per_minute['+Inf']:g}x{minutes}", **labels)]


def _recoveries(sym: dict, count: str, within: str) -> list[dict]:
    """The recovery histogram: `count` recoveries, `within` of them no longer than the alert's budget."""
    name, budget = "sightline_engine_recovery_seconds", float(sym["SightlineEngineRecoverySlow"]["threshold"])
    return [
        _s(f"{name}_count", count),
        _s(f"{name}_bucket", within, le=repr(budget)),
        _s(f"{name}_bucket", count, le="+Inf"),
    ]


def symptom_tests(spec: Spec) -> dict:
    """(alert, scenario, input series, minutes, expected labels of the firing alerts or [])."""
    sym = spec.symptoms
    stall = float(sym["SightlineEngineStalled"]["threshold"])
    drop = float(sym["SightlineStaleDropSpike"]["threshold"])
    timeouts = float(sym["SightlineRequestTimeouts"]["threshold"])
    retract = float(sym["SightlineRetractionsSustained"]["threshold"])
    inst = {k: BASE[k] for k in ("job", "instance")}
    model = {**inst, "model_name": BASE["model_name"]}
    service = {k: BASE[k] for k in ("job", "model_name")}  # service-level alerts: no instance
    rank0, rank1 = {**model, "dp_rank": "0"}, {**model, "dp_rank": "1"}  # engine gauges: one series per rank
    died = {**inst, "role": "detokenizer", "cause": "exited"}
    stalled = {**inst, "role": "scheduler", "cause": "stalled"}
    fails = "sightline_engine_failures_total"
    # 1200 lag samples a minute (one per 50 ms); the threshold is a bucket bound of the histogram
    lag = float(sym["SightlineEventLoopBlocked"]["threshold"])
    above = next(b for b in DEFAULT_BUCKETS["stage"] if b > lag)  # the next bucket up
    healthy_loop = {"0.01": 1200, f"{lag:g}": 1200, f"{above:g}": 1200, "+Inf": 1200}
    blocked_loop = {"0.01": 1000, f"{lag:g}": 1140, f"{above:g}": 1200, "+Inf": 1200}  # 5 % above the threshold
    loop = "sightline_event_loop_lag_seconds"
    shed, aborts = "sightline_requests_shed_total", "sightline_request_aborts_total"
    cases = [
        ("SightlineDown", "scrape fails", [_s("up", "1 1 0x20")], 15, [inst]),
        ("SightlineDown", "scrapes fine", [_s("up", "1x20")], 15, []),
        # three replicas, one down: the alert names that instance, once
        (
            "SightlineDown",
            "one replica of three down",
            [
                _s("up", "1x20", instance="a:8000"),
                _s("up", "1 1 0x20", instance="b:8000"),
                _s("up", "1x20", instance="c:8000"),
            ],
            15,
            [{**inst, "instance": "b:8000"}],
        ),
        (
            "SightlineEngineStalled",
            "requests in flight, no token",
            [_s("sightline_requests_in_flight", "2x30"), _s("sightline_seconds_since_last_token", f"0+{stall}x30")],
            10,
            [model],
        ),
        (
            "SightlineEngineStalled",
            "idle engine, nothing in flight",
            [_s("sightline_requests_in_flight", "0x30"), _s("sightline_seconds_since_last_token", f"0+{stall}x30")],
            10,
            [],
        ),
        (
            "SightlineEngineStalled",
            "busy and producing",
            [_s("sightline_requests_in_flight", "8x30"), _s("sightline_seconds_since_last_token", "0.05x30")],
            10,
            [],
        ),
        # several tokenizer workers: in flight is one series per worker; one alert, not one per worker
        (
            "SightlineEngineStalled",
            "two workers, one holds requests, no token",
            [
                _s("sightline_requests_in_flight", "0x30", worker="1"),
                _s("sightline_requests_in_flight", "3x30", worker="2"),
                _s("sightline_seconds_since_last_token", f"0+{stall}x30"),
            ],
            10,
            [model],
        ),
        (
            "SightlineQueueBacklogGrowing",
            "queue grows",
            [_s("sightline_num_requests_waiting", "0+2x40", dp_rank="0")],
            30,
            [rank0],
        ),
        (
            "SightlineQueueBacklogGrowing",
            "steady queue",
            [_s("sightline_num_requests_waiting", "12x40", dp_rank="0")],
            30,
            [],
        ),
        (
            "SightlineQueueBacklogGrowing",
            "two ranks, one queue grows",
            [
                _s("sightline_num_requests_waiting", "12x40", dp_rank="0"),
                _s("sightline_num_requests_waiting", "0+2x40", dp_rank="1"),
            ],
            30,
            [rank1],
        ),
        (
            "SightlineQueueStuck",
            "the head ages with room to admit it",
            [
                _s("sightline_queue_head_age_seconds", "0+60x20", dp_rank="0"),
                _s("sightline_queue_head_fits", "1x20", dp_rank="0"),
            ],
            10,
            [rank0],
        ),
        # saturation: the head waits for KV or the running limit, as it should
        (
            "SightlineQueueStuck",
            "the head ages without room",
            [
                _s("sightline_queue_head_age_seconds", "0+60x20", dp_rank="0"),
                _s("sightline_queue_head_fits", "0x20", dp_rank="0"),
            ],
            10,
            [],
        ),
        (
            "SightlineQueueStuck",
            "a queue that moves",
            [
                _s("sightline_queue_head_age_seconds", "0.2x20", dp_rank="0"),
                _s("sightline_queue_head_fits", "1x20", dp_rank="0"),
            ],
            10,
            [],
        ),
        (
            "SightlineQueueStuck",
            "two ranks, one stuck",
            [
                _s("sightline_queue_head_age_seconds", "0.2x20", dp_rank="0"),
                _s("sightline_queue_head_fits", "1x20", dp_rank="0"),
                _s("sightline_queue_head_age_seconds", "0+60x20", dp_rank="1"),
                _s("sightline_queue_head_fits", "1x20", dp_rank="1"),
            ],
            10,
            [rank1],
        ),
        (
            "SightlineKVCacheSaturated",
            "KV full",
            [_s("sightline_kv_in_use_ratio", "0.99x20", dp_rank="0")],
            15,
            [rank0],
        ),
        ("SightlineKVCacheSaturated", "KV half used", [_s("sightline_kv_in_use_ratio", "0.5x20", dp_rank="0")], 15, []),
        # committed above capacity (the estimate at work) while little is held: not saturated
        (
            "SightlineKVCacheSaturated",
            "committed high, little in use",
            [
                _s("sightline_kv_usage_ratio", "1.2x20", dp_rank="0"),
                _s("sightline_kv_in_use_ratio", "0.4x20", dp_rank="0"),
            ],
            15,
            [],
        ),
        (
            "SightlineKVCacheSaturated",
            "two ranks, one full",
            [
                _s("sightline_kv_in_use_ratio", "0.5x20", dp_rank="0"),
                _s("sightline_kv_in_use_ratio", "0.99x20", dp_rank="1"),
            ],
            15,
            [rank1],
        ),
        (
            "SightlineRetractionsSustained",
            "retractions at 10x the threshold",
            [_s("sightline_retractions_total", f"0+{retract * 600:g}x30", dp_rank="0")],
            25,
            [rank0],
        ),
        (
            "SightlineRetractionsSustained",
            "a burst of retractions, then calm",
            [_s("sightline_retractions_total", "0 20 40 60x30", dp_rank="0")],
            25,
            [],
        ),
        (
            "SightlineRetractionsSustained",
            "two ranks, one retracts",
            [
                _s("sightline_retractions_total", "5x30", dp_rank="0"),
                _s("sightline_retractions_total", f"0+{retract * 600:g}x30", dp_rank="1"),
            ],
            25,
            [rank1],
        ),
        (
            "SightlineStaleDropSpike",
            "drops at 10x the threshold",
            [
                _s(
                    "sightline_stale_messages_dropped_total",
                    f"0+{drop * 600:g}x30",
                    component="tokenizer_manager",
                    message_type="BatchStrOutput",
                    reason="client_disconnect",
                )
            ],
            20,
            [{**inst, "component": "tokenizer_manager", "reason": "client_disconnect"}],
        ),
        (
            "SightlineStaleDropSpike",
            "a few drops after disconnects",
            [
                _s(
                    "sightline_stale_messages_dropped_total",
                    f"0+{drop * 6:g}x30",
                    component="tokenizer_manager",
                    message_type="BatchStrOutput",
                    reason="client_disconnect",
                )
            ],
            20,
            [],
        ),
        (
            "SightlineUndecodableMessages",
            "a bad frame arrives",
            [_s("sightline_undecodable_messages_total", "0x10 1x10", component="scheduler")],
            12,
            [{**inst, "component": "scheduler"}],
        ),
        (
            "SightlineUndecodableMessages",
            "old count, nothing new",
            [_s("sightline_undecodable_messages_total", "3x30", component="scheduler")],
            20,
            [],
        ),
        # the first failure creates its series at 1, which `increase` reads as 0: still a page
        (
            "SightlineEngineRestarting",
            "first failure since start (the series exists at 0)",
            [_s(fails, "0x4 1x20", role="detokenizer", cause="exited")],
            8,
            [died],
        ),
        (
            "SightlineEngineRestarting",
            "another failure of a known kind",
            [
                _s(fails, "1x15 2x15", role="scheduler", cause="stalled"),
                _s(fails, "3x30", role="detokenizer", cause="exited"),
            ],
            20,
            [stalled],
        ),
        (
            "SightlineEngineRestarting",
            "the last failure is older than the window",
            [_s(fails, "0x4 1x30", role="detokenizer", cause="exited")],
            20,
            [],
        ),
        (
            "SightlineEngineRestarting",
            "a fresh server, no failure",
            [_s(fails, "0x30", role="scheduler", cause="stalled")],
            20,
            [],
        ),
        (
            "SightlineEngineRestarting",
            "failures long ago, none since",
            [_s(fails, "2x40", role="scheduler", cause="stalled")],
            30,
            [],
        ),
        (
            "SightlineEngineRecoverySlow",
            "one recovery over the budget",
            _recoveries(sym, "0x5 1x30", "0x30"),
            10,
            [inst],
        ),
        (
            "SightlineEngineRecoverySlow",
            "recoveries within the budget",
            _recoveries(sym, "0x5 2x30", "0x5 2x30"),
            10,
            [],
        ),
        (
            "SightlineEngineRecoverySlow",
            "the slow recovery is older than the window",
            _recoveries(sym, "0x5 1x60", "0x60"),
            50,
            [],
        ),
        (
            "SightlineLoadShedding",
            "shedding for 20 minutes",
            [_s(shed, "0+30x40", reason="queue_full")],
            30,
            [{**service, "reason": "queue_full"}],
        ),
        # a service-level alert: two replicas shedding make one alert, without an instance label
        (
            "SightlineLoadShedding",
            "two replicas shedding",
            [
                _s(shed, "0+30x40", reason="queue_full", instance="a:8000"),
                _s(shed, "0+10x40", reason="queue_full", instance="b:8000"),
            ],
            30,
            [{**service, "reason": "queue_full"}],
        ),
        # 2 min of 429s, checked 4 min later: the rate window still sees them, `for:` not yet met
        (
            "SightlineLoadShedding",
            "a short burst of 429s",
            [_s(shed, "0x5 0+20x2 40x30", reason="tokens_full")],
            11,
            [],
        ),
        ("SightlineLoadShedding", "no shedding for a while", [_s(shed, "0+30x10 300x40", reason="queue_full")], 40, []),
        (
            "SightlineRequestTimeouts",
            "timeouts at 10x the threshold",
            [_s(aborts, f"0+{timeouts * 600:g}x40", reason="timeout")],
            30,
            [service],
        ),
        (
            "SightlineRequestTimeouts",
            "timeouts at half the threshold",
            [_s(aborts, f"0+{timeouts * 30:g}x40", reason="timeout")],
            30,
            [],
        ),
        # 0.6 of the threshold on each of two replicas: the service's 1.2x fires, once
        (
            "SightlineRequestTimeouts",
            "two replicas, each under the threshold, the service over it",
            [
                _s(aborts, f"0+{timeouts * 36:g}x40", reason="timeout", instance="a:8000"),
                _s(aborts, f"0+{timeouts * 36:g}x40", reason="timeout", instance="b:8000"),
            ],
            30,
            [service],
        ),
        (
            "SightlineRequestTimeouts",
            "many disconnects, no timeouts",
            [_s(aborts, f"0+{timeouts * 600:g}x40", reason="client_disconnect")],
            30,
            [],
        ),
        (
            "SightlineEventLoopBlocked",
            "5 % of the samples late by more than the threshold",
            _lag(blocked_loop, role="main"),
            15,
            [{**inst, "role": "main"}],
        ),
        ("SightlineEventLoopBlocked", "a healthy loop", _lag(healthy_loop, role="main"), 15, []),
        # one 10 s stall (a GC pause, one huge body) is 1 sample of 6000 in 5 m: below p99
        (
            "SightlineEventLoopBlocked",
            "a single long stall",
            _lag(healthy_loop, role="main")[:-2]  # its finite buckets; +Inf and the count hold the stall
            + [
                _s(f"{loop}_{suffix}", "0+1200x9 10801+1200x20", role="main", **le)
                for suffix, le in (("bucket", {"le": "+Inf"}), ("count", {}))
            ],
            15,
            [],
        ),
        (
            "SightlineEventLoopBlocked",
            "two workers, one blocked",
            _lag(healthy_loop, role="worker-1") + _lag(blocked_loop, role="worker-2"),
            15,
            [{**inst, "role": "worker-2"}],
        ),
    ]
    rules = {r["alert"]: r for r in symptom_alerts(spec)}
    tests = []
    for alert, scenario, series, minutes, firing in cases:
        rule = rules[alert]
        exp = [
            {
                "exp_labels": {**labels, **rule["labels"]},
                "exp_annotations": {k: render(v, labels) for k, v in rule["annotations"].items()},
            }
            for labels in firing
        ]
        tests.append(
            {
                "name": f"{alert}: {scenario}",
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [{"eval_time": f"{minutes}m", "alertname": alert, "exp_alerts": exp}],
            }
        )
    return {"rule_files": ["../rules/symptoms.yml"], "evaluation_interval": "1m", "tests": tests}


def cost_tests(spec: Spec) -> dict:
    """CPU seconds per output token: 0.25 + 0.75 cores for 2 output tokens/s is 0.5 CPU-s a token."""
    cpu, tokens = "sightline_process_cpu_seconds_total", "sightline_generation_tokens_total"
    series = [_s(cpu, "0+15x30", role="main"), _s(cpu, "0+45x30", role="scheduler"), _s(tokens, "0+120x30")]
    job = {"job": BASE["job"]}
    checks = [
        (CPU_PER_TOKEN_BY_ROLE, {**job, "role": "main"}, 0.125),
        (CPU_PER_TOKEN_BY_ROLE, {**job, "role": "scheduler"}, 0.375),
        (CPU_PER_TOKEN_TOTAL, job, 0.5),
    ]
    tests = [
        {
            "name": "CPU seconds per output token, per role and in total",
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [
                {
                    "expr": f"{record}{_series_labels(labels)}",
                    "eval_time": "20m",
                    "exp_samples": [{"labels": record + _series_labels(labels), "value": value}],
                }
                for record, labels, value in checks
            ],
        },
        # no output tokens: no series, not +Inf
        {
            "name": "CPU seconds per output token, nothing generated",
            "interval": "1m",
            "input_series": [series[0], _s(tokens, "0x30")],
            "promql_expr_test": [
                {"expr": f"{record}", "eval_time": "20m", "exp_samples": []}
                for record in (CPU_PER_TOKEN_BY_ROLE, CPU_PER_TOKEN_TOTAL)
            ],
        },
    ]
    return {"rule_files": ["../rules/cost.yml"], "evaluation_interval": "1m", "tests": tests}


def utilisation_tests(spec: Spec) -> dict:
    """A rank doing 25 GFLOP/s and moving 3 GB/s against a measured 100 GFLOP/s and 12 GB/s: a quarter of each;
    a rank with no measured peak (--no-peak-probe) has no series."""
    rank = {"instance": BASE["instance"], "dp_rank": "0"}
    series = [
        _s("sightline_engine_flops_total", "0+1500000000000x30", phase="decode", **rank),
        _s("sightline_engine_bytes_total", "0+180000000000x30", phase="decode", **rank),
        _s("sightline_machine_peak_flops", "100000000000x30", **rank),
        _s("sightline_machine_peak_bytes_per_second", "12000000000x30", **rank),
    ]
    labels = {"job": BASE["job"], **rank}

    def check(kind: str, value: float | None) -> dict:
        record = PEAK_FRACTION[kind]
        return {
            "expr": record,
            "eval_time": "20m",
            "exp_samples": [] if value is None else [{"labels": record + _series_labels(labels), "value": value}],
        }

    unmeasured = [s if "peak" not in s["series"] else {**s, "values": "0x30"} for s in series]
    tests = [
        {
            "name": "utilisation: a quarter of peak compute and bandwidth",
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [check("flops", 0.25), check("bytes", 0.25)],
        },
        {
            "name": "utilisation: no measured peak, no series",
            "interval": "1m",
            "input_series": unmeasured,
            "promql_expr_test": [check("flops", None), check("bytes", None)],
        },
    ]
    return {"rule_files": ["../rules/utilisation.yml"], "evaluation_interval": "1m", "tests": tests}


def test_files(spec: Spec) -> dict[str, dict]:
    return {
        "slo_test.yml": slo_tests(spec),
        "symptoms_test.yml": symptom_tests(spec),
        "cost_test.yml": cost_tests(spec),
        "utilisation_test.yml": utilisation_tests(spec),
    }
