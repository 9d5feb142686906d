"""OpenTelemetry GenAI metrics over OTLP/HTTP from a real server to a real receiver decoding
ExportMetricsServiceRequest: names, units, bucket boundaries and attributes as the semantic
conventions give them, counts and token sums equal to what the HTTP responses said."""

from __future__ import annotations

import json
from collections import Counter

import httpx

from tests.otlp_receiver import OTLPReceiver
from tests.server_util import ServerProc, sse_events, wait_until

# The conventions' advisory ExplicitBucketBoundaries, written out here independently of the code.
SPEC = {
    "gen_ai.server.time_to_first_token": ("s", [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                                1.0, 2.5, 5.0, 7.5, 10.0]),
    "gen_ai.server.time_per_output_token": ("s", [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                                  1.0, 2.5]),
    "gen_ai.server.request.duration": ("s", [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                                             20.48, 40.96, 81.92]),
    "gen_ai.client.token.usage": ("{token}", [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576,
                                              4194304, 16777216, 67108864]),
}
ROUTES = {"chat": "/v1/chat/completions", "text_completion": "/v1/completions"}


def _body(op: str, stream: bool) -> dict:
    body = {"max_tokens": 5, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "hello there"}]} if op == "chat"
                else {"prompt": "Once upon a time"})
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
    srv = ServerProc("--otel-metrics-exporter", "otlp", "--otel-exporter-otlp-metrics-endpoint",
                     receiver.endpoint + "/v1/metrics", tmpdir=tmp_path,
                     env={"OTEL_METRIC_EXPORT_INTERVAL": "500", "OTEL_SDK_DISABLED": "", "OTEL_SERVICE_NAME": ""})
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
    finally:
        srv.stop()  # the last numbers are exported at shutdown
        receiver.close()

    latest = {name: receiver.latest_points(name) for name in SPEC}
    assert {p["name"] for p in receiver.points} == set(SPEC)
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
        ("chat", None): 2, ("text_completion", None): 2, ("chat", "invalid_json"): 1}
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
