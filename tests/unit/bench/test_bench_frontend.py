"""bench/frontend.py without servers: CPU % from two /metrics scrapes, the front end's
share of it, the other processes' share, the per-run numbers, the mean (min–max) and B/A
table, the request, the arguments."""

from __future__ import annotations

import math

import pytest

from bench.frontend import (
    CAPACITY_METRICS,
    DP_METRICS,
    alternate,
    capacity_numbers,
    dp_cpu,
    front_end_cpu,
    other_cpu_percent,
    parse_args,
    ratio,
    ratio_table,
    role_cpu_percent,
    run_line,
    spread,
)
from bench.frontend_client import capacity_body


def test_cpu_percent_is_cpu_seconds_over_wall_time_per_role():
    before = {"main": 10.0, "scheduler": 100.0, "detokenizer": 1.0}
    after = {"main": 15.0, "scheduler": 120.0, "detokenizer": 1.5}
    assert role_cpu_percent(before, after, 10.0) == pytest.approx(
        {"main": 50.0, "scheduler": 200.0, "detokenizer": 5.0}
    )


def test_a_replaced_process_counts_its_own_seconds_and_a_new_role_counts_from_zero():
    per_role = role_cpu_percent({"worker-1": 30.0, "gone": 5.0}, {"worker-1": 2.0, "worker-3": 1.0}, 4.0)
    assert per_role == pytest.approx({"worker-1": 50.0, "worker-3": 25.0})  # "gone" is left out
    with pytest.raises(ValueError):
        role_cpu_percent({}, {}, 0.0)


def test_one_front_end_is_main_several_are_the_workers_with_the_hub_apart():
    one = front_end_cpu({"main": 80.0, "scheduler": 30.0, "detokenizer": 5.0})
    assert one == pytest.approx({"front": 80.0, "hub": None, "engine": 35.0, "total": 115.0})
    two = front_end_cpu(
        {
            "main": 10.0,
            "worker-1": 60.0,
            "worker-2": 55.0,
            "scheduler_dp0": 20.0,
            "scheduler_dp1": 25.0,
            "detokenizer": 4.0,
        }
    )
    assert two == pytest.approx({"front": 115.0, "hub": 10.0, "engine": 49.0, "total": 174.0})


def test_capacity_numbers_of_one_run():
    clients = [
        {"latency_s": [0.01] * 90 + [0.5] * 10, "errors": {"HTTP 503": 2}, "cpu_s": 4.0},
        {"latency_s": [0.02] * 100, "errors": {"HTTP 503": 1, "ReadTimeout": 1}, "cpu_s": 3.0},
    ]
    r = capacity_numbers(clients, {"front": 150.0, "hub": 10.0, "engine": 30.0, "total": 190.0}, 10.0, 275.0)
    assert (r["req_s"], r["completed"], r["errors"]) == (20.0, 200, 4)
    assert r["error_kinds"] == {"HTTP 503": 3, "ReadTimeout": 1}
    assert r["p50_ms"] == pytest.approx(20.0) and r["p99_ms"] == pytest.approx(500.0)
    assert (r["client_cpu_pct"], r["other_cpu_pct"]) == pytest.approx((70.0, 15.0))
    assert r["front_cpu_ms_per_req"] == pytest.approx(75.0)  # 1.5 cores = 1500 ms/s over 20 req/s
    assert (r["front_cpu_pct"], r["hub_cpu_pct"], r["engine_cpu_pct"], r["server_cpu_pct"]) == (
        150.0,
        10.0,
        30.0,
        190.0,
    )
    nothing = capacity_numbers(
        [{"latency_s": [], "errors": {"ConnectError": 5}, "cpu_s": 0.1}],
        {"front": 0.0, "hub": None, "engine": 0.0, "total": 0.0},
        5.0,
        2.0,
    )
    assert (nothing["req_s"], nothing["p50_ms"], nothing["front_cpu_ms_per_req"], nothing["errors"]) == (
        0.0,
        None,
        None,
        5,
    )


def test_spread_and_ratio_skip_what_is_missing():
    assert spread([3.0, 1.0, None, 2.0, math.nan]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([None, None]) is None and spread([]) is None
    assert ratio(spread([100.0, 110.0]), spread([200.0, 220.0])) == pytest.approx(2.0)
    assert ratio(spread([0.0]), spread([1.0])) is None and ratio(None, spread([1.0])) is None


def test_ratio_table_rows():
    a = [{"req_s": 100.0, "hub_cpu_pct": None, "errors": 0}, {"req_s": 120.0, "hub_cpu_pct": None, "errors": 0}]
    b = [{"req_s": 180.0, "hub_cpu_pct": 9.0, "errors": 2}, {"req_s": 150.0, "hub_cpu_pct": 11.0, "errors": 2}]
    metrics = [("req_s", "requests/s", ".1f"), ("hub_cpu_pct", "hub CPU %", ".0f"), ("errors", "errors", ".0f")]
    text = ratio_table("1 worker", "2 workers", a, b, metrics)
    assert text.splitlines() == [
        "| metric | 1 worker | 2 workers | B/A |",
        "|---|---:|---:|---:|",
        "| requests/s | 110.0 (100.0–120.0) | 165.0 (150.0–180.0) | 1.50 |",
        "| hub CPU % | – | 10 (9–11) | – |",
        "| errors | 0 | 2 | – |",
    ]
    assert run_line(a[0], metrics) == "requests/s 100.0, hub CPU % –, errors 0"
    # every capacity metric renders from capacity_numbers' keys
    r = capacity_numbers(
        [{"latency_s": [0.01], "errors": {}, "cpu_s": 1.0}],
        {"front": 50.0, "hub": None, "engine": 5.0, "total": 55.0},
        1.0,
        200.0,
    )
    assert all(key in r for key, _, _ in CAPACITY_METRICS)
    assert len(ratio_table("A", "B", [r], [r], CAPACITY_METRICS).splitlines()) == 2 + len(CAPACITY_METRICS)
    assert all(title in run_line(r, CAPACITY_METRICS) for _, title, _ in CAPACITY_METRICS)


def test_runs_alternate():
    assert alternate(1, 2, 3) == [1, 2, 1, 2, 1, 2]


def test_the_capacity_request_is_one_token_not_streamed():
    body = capacity_body("Request 1: say hello.")
    assert body["stream"] is False and "stream_options" not in body  # the server refuses stream_options unstreamed
    assert (body["max_tokens"], body["ignore_eos"], body["temperature"]) == (1, True, 0)


def test_arguments():
    a = parse_args([])
    assert (a.parts, a.repeats, a.tokenizer_workers, a.dp_sizes, a.capacity_model, a.dp_model) == (
        ["capacity", "dp"],
        3,
        [1, 2],
        [1, 2],
        "tiny-random",
        "smollm2-135m",
    )
    a = parse_args(["--parts", "dp", "--gen-len", "8", "--concurrency", "16", "--dp-sizes", "1,4"])
    assert (a.parts, a.gen_len, a.concurrency, a.dp_sizes) == (["dp"], 8, 16, [1, 4])
    for bad in (["--parts", "nope"], ["--repeats", "0"], ["--dp-sizes", "1,2,3"], ["--client-procs", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_other_processes_cpu_is_what_the_machine_used_beyond_server_and_client():
    assert other_cpu_percent(190.0, 120.0, 50.0) == pytest.approx(20.0)
    assert other_cpu_percent(160.0, 120.0, 50.0) == 0.0  # readings a few ms apart: never negative
    marks = [
        (100.0, 1000.0, {"main": 1.0, "scheduler": 10.0}, 5.0),
        (110.0, 1018.0, {"main": 2.0, "scheduler": 20.0}, 7.0),
    ]
    r = dp_cpu(marks)
    assert r["role_cpu_pct"] == pytest.approx({"main": 10.0, "scheduler": 100.0})
    assert (r["server_cpu_pct"], r["client_cpu_pct"], r["machine_cpu_pct"], r["other_cpu_pct"]) == pytest.approx(
        (110.0, 20.0, 180.0, 50.0)
    )
    assert all(key in r for key, _, _ in DP_METRICS if key.endswith("cpu_pct"))
