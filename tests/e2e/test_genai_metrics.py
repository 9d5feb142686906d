"""OpenTelemetry GenAI metrics over OTLP/HTTP from a real server to a real receiver decoding
ExportMetricsServiceRequest: names, units, bucket boundaries and attributes as the semantic
conventions give them, the legacy and the latest token instruments side by side
(--otel-genai-semconv both), counts and token sums equal to what the HTTP responses said; and the
whole Prometheus catalogue beside them (--otel-metrics-catalogue): per-request histograms as
exponential histograms, counters equal to /metrics, the exports counted."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from telemetry.genai_instruments import SCHEMA_URL
from tests.otlp_receiver import OTLPReceiver
from tests.server_util import ServerProc, scrape, sse_events, value, wait_until

# The conventions' advisory ExplicitBucketBoundaries, written out here independently of the code.
SPEC = {
    "gen_ai.server.time_to_first_token": (
        "s",
        [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0],
    ),
    "gen_ai.server.time_per_output_token": (
        "s",
        [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5],
    ),
    "gen_ai.server.request.duration": (
        "s",
        [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92],
    ),
    "gen_ai.client.token.usage": (
        "{token}",
        [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864],
    ),
}
# The latest conventions' token instruments (semantic-conventions-genai): counters by modality, histograms.
USAGE = {
    "gen_ai.client.inference.usage.input_tokens": "prompt_tokens",
    "gen_ai.client.inference.usage.output_tokens": "completion_tokens",
}
OPERATION = {
    "gen_ai.client.inference.operation.input_tokens": "prompt_tokens",
    "gen_ai.client.inference.operation.output_tokens": "completion_tokens",
}
ROUTES = {"chat": "/v1/chat/completions", "text_completion": "/v1/completions"}


def _body(op: str, stream: bool) -> dict:
    body = {"max_tokens": 5, "stream": stream}
    body.update(
        {"messages": [{"role": "user", "content": "hello there"}]} if op == "chat" else {"prompt": "Once upon a time"}
    )
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _send(srv: ServerProc, op: str, stream: bool) -> dict:
    """One request; the usage its response reported."""
    if not stream:
        r = srv.post(ROUTES[op], _body(op, False))
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    with httpx.stream("POST", srv.url + ROUTES[op], json=_body(op, True), timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    return next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage") and not e.get("choices"))


def _by(points, *keys):
    return {tuple(p["attributes"].get(k) for k in keys): p for p in points}


def test_genai_metrics_over_otlp(tmp_path):
    receiver = OTLPReceiver()
    srv = ServerProc(
        "--otel-metrics-exporter",
        "otlp",
        "--otel-exporter-otlp-metrics-endpoint",
        receiver.endpoint + "/v1/metrics",
        "--otel-genai-semconv",
        "both",
        "--otel-metrics-catalogue",
        tmpdir=tmp_path,
        env={"OTEL_METRIC_EXPORT_INTERVAL": "500", "OTEL_SDK_DISABLED": "", "OTEL_SERVICE_NAME": ""},
    )
    usage: dict[str, list[dict]] = {"chat": [], "text_completion": []}
    try:
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        usage["chat"].append(_send(srv, "chat", False))
        # exported periodically while the server runs
        wait_until(lambda: receiver.latest_points("gen_ai.server.request.duration"), 15, "a periodic export")
        usage["chat"].append(_send(srv, "chat", True))
        usage["text_completion"].append(_send(srv, "text_completion", False))
        usage["text_completion"].append(_send(srv, "text_completion", True))
        bad = srv.post(ROUTES["chat"], b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        prometheus = scrape(srv)  # nothing more is sent: the last export holds these numbers
    finally:
        srv.stop()  # the last numbers are exported at shutdown
        receiver.close()

    latest = {name: receiver.latest_points(name) for name in SPEC}
    assert {p["name"] for p in receiver.points if p["name"].startswith("gen_ai.")} == set(SPEC) | set(USAGE) | {
        "gen_ai.client.inference.usage.cache_read.input_tokens"
    } | set(OPERATION)
    assert {p["schema_url"] for p in receiver.points} == {SCHEMA_URL}
    for name, (unit, bounds) in SPEC.items():
        assert latest[name], name
        for p in latest[name]:
            assert p["kind"] == "histogram" and p["unit"] == unit and p["bounds"] == bounds, (name, p)
            assert p["temporality"] == 2  # cumulative: the newest point holds the totals
            assert p["scope"] == "sightline"
            assert p["resource"]["service.name"] == "sightline" and p["resource"]["service.instance.id"]
            attrs = p["attributes"]
            assert attrs["gen_ai.provider.name"] == "sightline"
            assert attrs["gen_ai.request.model"] == model and attrs["gen_ai.response.model"] == model
            assert attrs["gen_ai.operation.name"] in ROUTES
            if name != "gen_ai.server.request.duration":
                assert "error.type" not in attrs  # recorded for successful responses only

    duration = _by(latest["gen_ai.server.request.duration"], "gen_ai.operation.name", "error.type")
    assert {k: p["count"] for k, p in duration.items()} == {
        ("chat", None): 2,
        ("text_completion", None): 2,
        ("chat", "invalid_json"): 1,
    }
    ttft = _by(latest["gen_ai.server.time_to_first_token"], "gen_ai.operation.name")
    assert {k: p["count"] for k, p in ttft.items()} == {("chat",): 2, ("text_completion",): 2}
    for op in ROUTES:  # TTFT within the request's duration
        assert 0 < ttft[(op,)]["sum"] <= duration[(op, None)]["sum"]
    tpot = Counter(op for op, us in usage.items() for u in us if u["completion_tokens"] >= 2)
    tpot_points = _by(latest["gen_ai.server.time_per_output_token"], "gen_ai.operation.name")
    assert {k[0]: p["count"] for k, p in tpot_points.items()} == dict(tpot)

    tokens = _by(latest["gen_ai.client.token.usage"], "gen_ai.operation.name", "gen_ai.token.type")
    for op, us in usage.items():
        for kind, field in (("input", "prompt_tokens"), ("output", "completion_tokens")):
            p = tokens[(op, kind)]
            assert p["count"] == len(us) and p["sum"] == sum(u[field] for u in us), (op, kind, json.dumps(us))
            assert sum(p["bucket_counts"]) == p["count"]

    # the latest names: counters by modality (every request; the refused one as 0 `unknown`), histograms
    for name, field in USAGE.items():
        points = _by(receiver.latest_points(name), "gen_ai.operation.name", "gen_ai.token.modality")
        assert all(p["kind"] == "sum" and p["monotonic"] and p["unit"] == "{token}" for p in points.values())
        assert {k: p["value"] for k, p in points.items()} == {
            **{(op, "text"): sum(u[field] for u in us) for op, us in usage.items()},
            ("chat", "unknown"): 0,
        }
    for name, field in OPERATION.items():
        points = _by(receiver.latest_points(name), "gen_ai.operation.name")
        for op, us in usage.items():
            p = points[(op,)]
            assert p["bounds"] == SPEC["gen_ai.client.token.usage"][1]
            assert "gen_ai.token.modality" not in p["attributes"]
            assert p["count"] == len(us) and p["sum"] == sum(u[field] for u in us), (name, op)

    # the catalogue: TTFT as an exponential histogram (4 requests produced a token), counters as on /metrics
    ttft_exp = receiver.latest_points("sightline_time_to_first_token_seconds")  # one point per route
    assert {p["attributes"]["route"] for p in ttft_exp} == {"/v1/completions", "/v1/chat/completions"}
    assert all(p["kind"] == "exponential_histogram" and p["unit"] == "s" and p["scale"] > 0 for p in ttft_exp)
    assert sum(p["count"] for p in ttft_exp) == 4
    assert sum(p["zero_count"] + sum(p["positive_counts"]) for p in ttft_exp) == 4
    ttft_sum = value(prometheus, "sightline_time_to_first_token_seconds_sum")
    assert sum(p["sum"] for p in ttft_exp) == pytest.approx(ttft_sum)
    requests = receiver.latest_points("sightline_requests")
    assert requests and all(p["kind"] == "sum" and p["monotonic"] for p in requests)
    assert sum(p["value"] for p in requests) == value(prometheus, "sightline_requests_total") == 5
    phases = receiver.latest_points("sightline_engine_step_phase_seconds")  # the engine's keep their buckets
    assert phases and all(
        p["kind"] == "histogram" and p["bounds"] and sum(p["bucket_counts"]) == p["count"] for p in phases
    )
    assert sum(p["count"] for p in phases) == value(prometheus, "sightline_engine_step_phase_seconds_count")
    exports = receiver.latest_points("sightline_otlp_metric_exports")
    assert [p["attributes"]["result"] for p in exports if p["value"] > 0] == ["ok"], exports
