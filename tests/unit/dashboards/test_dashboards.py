"""Dashboards as code: committed files equal the generator's output and pass the lint.

The lint (dashboards/lint.py) is itself tested on bad input, so a lint that stopped
looking would fail here too.  Whether each query returns data from a real server is
the live test's job (test_alerting.py).
"""

from __future__ import annotations

import re

import pytest
import yaml

from dashboards import generate, lint
from dashboards.generate import DASHBOARD_DIR
from telemetry.metrics import BY_NAME
from tests.helpers import REPO, boards, exprs

GRAFANA = REPO / "dashboards/grafana"
UIDS = ["sightline-overview", "sightline-latency", "sightline-engine", "sightline-slo", "sightline-troubleshooting"]


def test_committed_files_are_what_the_generator_writes():
    diff = generate.differences(generate.outputs())
    assert diff == [], f"out of date (run `.venv/bin/python -m dashboards.generate`): {diff}"


def test_generator_check_mode_reports_a_hand_edit(tmp_path):
    generate.write(tmp_path, generate.outputs())
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    edited = tmp_path / DASHBOARD_DIR / "sightline-slo.json"
    edited.write_text(edited.read_text().replace("error budget remaining", "budget"))
    (tmp_path / DASHBOARD_DIR / "old-board.json").write_text("{}")
    assert generate.differences(generate.outputs(), tmp_path) == [
        f"{DASHBOARD_DIR}/old-board.json",
        f"{DASHBOARD_DIR}/sightline-slo.json",
    ]


def test_every_board_passes_the_lint_and_has_a_stable_uid():
    found = boards()
    assert sorted(found) == sorted(UIDS)
    for uid, board in found.items():
        assert board["uid"] == uid
        assert lint.dashboard_problems(board) == [], uid
        ids = [p["id"] for p in board["panels"]]  # rows are open: every panel is at the top level
        assert len(ids) == len(set(ids)) and 0 not in ids, uid


@pytest.mark.parametrize(
    "expr, problem",
    [
        ("sum(sightline_requests_total)", "counter sightline_requests_total outside"),
        ("sightline_time_to_first_token_seconds_count / 2", "counter sightline_time_to_first_token_seconds_count"),
        ("histogram_quantile(0.9, sum by (le) (x_bucket))", "counter x_bucket outside"),
        ("sum(rate(sightline_requests_total[5m]))", "range [5m] is not [$__rate_interval]"),
        ("max_over_time(sightline_kv_usage_ratio[1h])", "range [1h] is not"),
    ],
)
def test_lint_catches_bad_queries(expr, problem):
    assert any(p.startswith(problem) for p in lint.expr_problems(expr, dashboard=True)), expr


def test_lint_accepts_gauges_named_like_counters_and_labels_in_by():
    ok = (
        'sum by (le, hop) (rate(sightline_ipc_hop_latency_seconds_bucket{hop="a_total"}[$__rate_interval]))'
        " / on (job) group_left (x_total) sum(sightline_kv_slots_capacity)"
    )
    assert lint.expr_problems(ok, dashboard=True) == []
    assert lint.metric_names(ok) == {"sightline_ipc_hop_latency_seconds_bucket", "sightline_kv_slots_capacity"}


def test_lint_catches_bare_panels():
    board = {
        "uid": "x",
        "templating": {"list": [{"name": "job"}]},
        "panels": [{"type": "row", "panels": [{"title": "t", "type": "timeseries", "targets": []}]}],
    }
    problems = lint.dashboard_problems(board)
    for expected in ("no description", "no unit", "no queries", "datasource", "no $instance", "no $model_name"):
        assert any(expected in p for p in problems), (expected, problems)


def test_overview_covers_the_issue_list():
    text = "\n".join(exprs(boards()["sightline-overview"]))
    for metric in ("time_to_first_token", "inter_token_latency", "time_per_output_token", "e2e_request_latency"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(sightline_{metric}_seconds_bucket" in text
        assert f"rate(sightline_{metric}_seconds_sum" in text  # the mean
    for needle in (
        "sum by (outcome) (rate(sightline_requests_total",
        'status=~"5.."',
        "sightline_prompt_tokens_total",
        "sightline_generation_tokens_total",
        "sightline_num_requests_running",
        "sightline_num_requests_waiting",
        "sightline_requests_in_flight",
        "sightline_kv_usage_ratio",
        "sightline_kv_in_use_ratio",
    ):
        assert needle in text, needle


def test_latency_board_has_every_stage_stacked_and_exemplars_on():
    board = boards()["sightline-latency"]
    stacked = [p for p in lint.panels(board) if p["fieldConfig"]["defaults"].get("custom", {}).get("stacking")]
    legends = {t["legendFormat"] for p in stacked for t in p["targets"]}
    for stage in (
        "tokenize",
        "hop TM → Scheduler",
        "queue",
        "prefill",
        "decode",
        "hop Scheduler → Detokenizer",
        "detokenize",
        "hop Detokenizer → TM",
    ):
        assert stage in legends, stage
    quantile_panels = [p for p in lint.panels(board) if "histogram_quantile" in p["targets"][0]["expr"]]
    assert len(quantile_panels) == 8  # the six request stages, embeddings end to end and queue/prefill
    embed = [p for p in quantile_panels if "sightline_embedding_request_latency_seconds" in p["targets"][0]["expr"]]
    assert [p["title"] for p in embed] == ["Embeddings end to end", "Embeddings queue and prefill"]
    for p in quantile_panels:  # one target shows the exemplars: the p99, where the slow requests are
        [shown] = [t for t in p["targets"] if t.get("exemplar")]
        assert shown["expr"].startswith("histogram_quantile(0.99, "), p["title"]


def test_exemplars_open_traces_in_the_provisioned_tempo():
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/datasources.yaml").read_text())["datasources"]
    by_type = {d["type"]: d for d in sources}
    assert by_type["prometheus"]["uid"] == "prometheus"
    [dest] = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest == {"name": "trace_id", "datasourceUid": by_type["tempo"]["uid"]}
    # every panel queries the provisioned Prometheus (the lint checks the uid on each board)
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/dashboards.yaml").read_text())["providers"]
    assert [p["type"] for p in providers] == ["file"]


def test_slo_and_troubleshooting_boards():
    slo_text = "\n".join(exprs(boards()["sightline-slo"]))
    assert "ALERTS{" in slo_text and "sightline_slo_error_budget_remaining:ratio" in slo_text
    for window in ("5m", "30m", "1h", "2h", "6h", "1d", "3d"):
        assert f"sightline_slo_errors:ratio_rate{window}{{" in slo_text, window
    assert (
        'sum(rate(sightline_request_slo_total{job=~"$job", instance=~"$instance", slo="all", met="true"}' in slo_text
    )  # server-side goodput
    trouble = lint.panels(boards()["sightline-troubleshooting"])
    assert len(trouble) == 17 and all(p["title"].endswith("?") for p in trouble)
    text = "\n".join(exprs(boards()["sightline-troubleshooting"]))
    for needle in (
        "sum by (role, cause) (increase(sightline_engine_failures_total",
        "increase(sightline_engine_restarts_total",
        "sum by (reason) (rate(sightline_requests_shed_total",
        'status!="200"}',
        'sightline_request_aborts_total{job=~"$job", instance=~"$instance", '
        'model_name=~"$model_name", reason="timeout"}',
        "sum by (reason) (rate(sightline_request_wait_seconds_sum",
        "sum by (cause) (increase(sightline_decode_gaps_total",
        "sum by (reason) (increase(sightline_prefix_cache_misses_total",
        "sum by (tenant, slo) (rate(sightline_request_slo_total",
        "sum by (instance, result) (rate(sightline_otlp_metric_exports_total",
    ):
        assert needle in text, needle


HIT_RATIO = (
    'sum(rate(sightline_prefix_cache_hits_tokens_total{job=~"$job", instance=~"$instance", '
    'model_name=~"$model_name"}[$__rate_interval]))\n/\nsum(rate(sightline_prefix_cache_queries_tokens_total'
    '{job=~"$job", instance=~"$instance", model_name=~"$model_name"}[$__rate_interval]))'
)


def test_prefix_cache_panels():
    engine = {p["title"]: p for p in lint.panels(boards()["sightline-engine"])}
    ratio = engine["Prefix cache hit ratio"]
    assert [t["expr"] for t in ratio["targets"]] == [HIT_RATIO]
    assert ratio["fieldConfig"]["defaults"]["unit"] == "percentunit"
    size = "\n".join(t["expr"] for t in engine["Prefix cache size and evictions"]["targets"])
    assert "sum(sightline_prefix_cache_tokens{" in size
    assert "sum(rate(sightline_prefix_cache_evicted_tokens_total{" in size
    assert any("sightline_prefix_cache_tokens{" in t["expr"] for t in engine["KV slots"]["targets"])
    trouble = {p["title"]: p for p in lint.panels(boards()["sightline-troubleshooting"])}
    targets = trouble["TTFT jumped: did the prefix-cache hit ratio drop?"]["targets"]
    assert [t["legendFormat"] for t in targets] == ["TTFT p50", "TTFT p99", "prefix-cache hit ratio"]
    assert targets[0]["expr"].startswith(
        "histogram_quantile(0.5, sum by (le) (rate(sightline_time_to_first_token_seconds_bucket"
    )
    assert targets[1]["expr"].startswith("histogram_quantile(0.99, ")
    assert targets[2]["expr"] == HIT_RATIO


def test_every_metric_the_assets_use_is_in_the_catalogue():
    used = set()
    for board in boards().values():
        used |= {m for e in exprs(board) for m in lint.metric_names(e)}
        used |= {re.match(r"label_values\((\w+)", v["query"]).group(1) for v in board["templating"]["list"]}
    for path in (REPO / "dashboards/prometheus/rules").glob("*.yml"):
        used |= {m for _, e in lint.rule_exprs(yaml.safe_load(path.read_text())) for m in lint.metric_names(e)}
    ours = {m for m in used if m.startswith("sightline_") and ":" not in m}
    unknown = {m for m in ours if m not in BY_NAME and re.sub(r"_(bucket|count|sum)$", "", m) not in BY_NAME}
    assert unknown == set()
    assert used - ours <= {"up", "ALERTS"} | {m for m in used if ":" in m}


def test_overview_has_a_row_per_worker_and_rank():
    """--dp-size ranks (dp_rank), --tokenizer-worker-num workers (worker) and processes (role)."""
    board = boards()["sightline-overview"]
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows[-1] == "Workers and ranks"
    row = board["panels"][[p.get("title") for p in board["panels"]].index("Workers and ranks") + 1 :]
    panels = {p["title"]: p for p in row}
    by = {title: [(t["expr"], t["legendFormat"]) for t in p["targets"]] for title, p in panels.items()}
    m = 'job=~"$job", instance=~"$instance", model_name=~"$model_name"'
    # rank 0 of one replica is not rank 0 of another: every series is per instance too
    assert by["Running and waiting by rank"] == [
        (
            f"sum by (instance, dp_rank) (sightline_num_requests_running{{{m}}})",
            "running {{instance}} rank {{dp_rank}}",
        ),
        (
            f"sum by (instance, dp_rank) (sightline_num_requests_waiting{{{m}}})",
            "waiting {{instance}} rank {{dp_rank}}",
        ),
    ]
    assert by["KV usage ratio by rank"] == [
        (f"max by (instance, dp_rank) (sightline_kv_in_use_ratio{{{m}}})", "{{instance}} rank {{dp_rank}}")
    ]
    assert by["Generated tokens/s by rank"] == [
        (
            f"sum by (instance, dp_rank) (rate(sightline_scheduler_generated_tokens_total{{{m}}}[$__rate_interval]))",
            "{{instance}} rank {{dp_rank}}",
        )
    ]
    [(ratio, _)] = by["Prefix cache hit ratio by rank"]  # numerator and denominator match one-to-one per rank
    assert ratio == HIT_RATIO.replace("sum(rate(", "sum by (instance, dp_rank) (rate(")
    [(in_flight, legend), (conns, _)] = by["In flight and open connections by worker"]
    assert in_flight.startswith("sum by (instance, worker) (sightline_requests_in_flight{")
    assert legend == "in flight {{instance}} worker {{worker}}"
    assert conns.startswith("sum by (instance, worker) (sightline_http_connections_open{")
    assert by["CPU by process"] == [
        (
            'sum by (instance, role) (rate(sightline_process_cpu_seconds_total{job=~"$job", '
            'instance=~"$instance"}[$__rate_interval]))',
            "{{instance}} {{role}}",
        )
    ]
    [(up, _), (failures, _)] = by["Tokenizer workers up and worker failures"]
    assert up == 'sum by (instance) (sightline_tokenizer_workers{job=~"$job", instance=~"$instance"})'
    # with one worker the failures counter has no series: the panel reads 0, not "no data"
    assert failures == (
        'sum by (instance) (increase(sightline_worker_failures_total{job=~"$job", '
        f'instance=~"$instance"}}[$__rate_interval]))\nor 0 * {up}'
    )


def test_event_loop_row_shows_lag_beside_cpu_per_front_end_process():
    """Loop lag p99 / max per process (role: main, worker-N) beside that process's CPU."""
    board = boards()["sightline-troubleshooting"]
    top = board["panels"]
    i = [p.get("title") for p in top].index("Is the TokenizerManager loop blocked?")
    assert top[i]["type"] == "row"
    lag, cpu = top[i + 1], top[i + 2]
    sel = 'job=~"$job", instance=~"$instance"'
    # per process of each instance: summed over replicas, 1 core would no longer mean "saturated"
    bucket = f"sum by (le, instance, role) (rate(sightline_event_loop_lag_seconds_bucket{{{sel}}}[$__rate_interval]))"
    assert [(t["expr"], t["legendFormat"]) for t in lag["targets"]] == [
        (f"histogram_quantile(0.99, {bucket})", "p99 {{instance}} {{role}}"),
        (f"histogram_quantile(1.0, {bucket})", "max {{instance}} {{role}}"),
        (
            f"sum by (instance, role) (rate(sightline_event_loop_lag_seconds_sum{{{sel}}}[$__rate_interval]))",
            "late share {{instance}} {{role}}",
        ),
    ]
    assert [(t["expr"], t["legendFormat"]) for t in cpu["targets"]] == [
        (
            f'sum by (instance, role) (rate(sightline_process_cpu_seconds_total{{{sel}, role=~"main|worker-.*"}}'
            "[$__rate_interval]))",
            "{{instance}} {{role}}",
        )
    ]
    assert (
        cpu["title"] == "Is the TokenizerManager CPU-bound?" and cpu["fieldConfig"]["defaults"]["unit"] == "percentunit"
    )
    assert lag["gridPos"]["y"] == cpu["gridPos"]["y"]  # side by side
    # the lag histogram is kept per front-end process, the label the CPU counter has
    assert BY_NAME["sightline_event_loop_lag_seconds"].labels == BY_NAME["sightline_process_cpu_seconds_total"].labels


def test_overview_prices_a_token_in_cpu_seconds():
    panels = {p["title"]: p for p in lint.panels(boards()["sightline-overview"])}
    targets = panels["CPU seconds per output token"]["targets"]
    by_role, total = (t["expr"] for t in targets)
    tokens = (
        '(sum(rate(sightline_generation_tokens_total{job=~"$job", instance=~"$instance", '
        'model_name=~"$model_name"}[$__rate_interval])) > 0)'
    )
    cpu = 'rate(sightline_process_cpu_seconds_total{job=~"$job", instance=~"$instance"}[$__rate_interval])'
    assert by_role == f"sum by (role) ({cpu})\n/ on () group_left ()\n{tokens}"
    assert total == f"sum({cpu})\n/\n{tokens}"
    rules = {
        r["record"]: r["expr"]
        for r in yaml.safe_load((REPO / "dashboards/prometheus/rules/cost.yml").read_text())["groups"][0]["rules"]
    }
    assert set(rules) == {
        "job_role:sightline_cpu_seconds_per_output_token:rate5m",
        "job:sightline_cpu_seconds_per_output_token:rate5m",
    }


def test_overview_has_a_which_replica_is_bad_row():
    """One series per instance for request rate, 5xx ratio, TTFT p99, queue, KV and up."""
    board = boards()["sightline-overview"]
    top = board["panels"]
    i = [p.get("title") for p in top].index("Which replica is bad?")
    assert top[i]["type"] == "row" and i < [p.get("title") for p in top].index("Latency")
    row = {p["title"]: p for p in top[i + 1 : i + 7]}
    assert list(row) == [
        "Request rate by instance",
        "5xx ratio by instance",
        "TTFT p99 by instance",
        "Waiting and in flight by instance",
        "KV usage by instance",
        "Up by instance",
    ]
    for title, panel in row.items():
        for t in panel["targets"]:
            assert "{{instance}}" in t["legendFormat"], title
            assert t["expr"].startswith("up{") or "by (instance)" in t["expr"] or "by (le, instance)" in t["expr"], (
                title
            )
    m = 'job=~"$job", instance=~"$instance", model_name=~"$model_name"'
    assert row["Request rate by instance"]["targets"][0]["expr"] == (
        f"sum by (instance) (rate(sightline_requests_total{{{m}}}[$__rate_interval]))"
    )
    assert row["TTFT p99 by instance"]["targets"][0]["expr"].startswith(
        "histogram_quantile(0.99, sum by (le, instance) (rate(sightline_time_to_first_token_seconds_bucket{"
    )
    # a down instance stays on the panel (up == 0); targets of other jobs (Prometheus itself) do not
    assert row["Up by instance"]["targets"][0]["expr"] == (
        'up{job=~"$job", instance=~"$instance"}\nand on (job)\nsightline_build_info{job=~"$job"}'
    )


def test_alerts_aggregate_at_their_scope():
    """Service alerts sum the instances (no `instance` in their grouping or summary); instance
    alerts keep and name it."""
    from dashboards import rules, slo

    spec = slo.load()
    alerts = rules.burn_alerts(spec) + rules.symptom_alerts(spec)
    assert {a["alert"] for a in alerts} == set(rules.SCOPE)
    for rule in rules.recording_rules(spec):
        assert "instance" not in rule["expr"], rule["record"]
    for a in alerts:
        summary = a["annotations"]["summary"]
        if rules.SCOPE[a["alert"]] == "service":
            assert "instance" not in a["expr"] and "instance" not in summary, a["alert"]
        else:
            assert summary.startswith("{{ $labels.instance }}"), a["alert"]
            groupings = re.findall(r"\b(?:by|on) \(([^)]*)\)", a["expr"])
            assert all("instance" in g for g in groupings), (a["alert"], groupings)
