"""The GenAI conventions' modes and the OTLP catalogue in-process, pushed to a real OTLP receiver:
which names each mode emits, the registry's families as OTLP metrics (Prometheus buckets turned into
per-bucket counts), per-request histograms as exponential ones, exports counted ok and failed."""

from __future__ import annotations

import socket

import pytest

from telemetry.genai_instruments import INSTRUMENTS, SCHEMA_URL, resolve_semconv
from telemetry.genai_metrics import GenAIMetrics
from telemetry.metrics import Metrics
from tests.otlp_receiver import OTLPReceiver
from tests.server_util import wait_until

LEGACY = {
    "gen_ai.server.time_to_first_token",
    "gen_ai.server.time_per_output_token",
    "gen_ai.server.request.duration",
    "gen_ai.client.token.usage",
}
LATEST = LEGACY - {"gen_ai.client.token.usage"} | {
    "gen_ai.client.inference.usage.input_tokens",
    "gen_ai.client.inference.usage.output_tokens",
    "gen_ai.client.inference.usage.cache_read.input_tokens",
    "gen_ai.client.inference.operation.input_tokens",
    "gen_ai.client.inference.operation.output_tokens",
}


@pytest.mark.parametrize(
    "flag, env, mode",
    [
        (None, {}, "legacy"),
        (None, {"OTEL_SEMCONV_STABILITY_OPT_IN": "http,gen_ai_latest_experimental"}, "latest"),
        (None, {"OTEL_SEMCONV_STABILITY_OPT_IN": "http/dup"}, "legacy"),
        ("both", {"OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_latest_experimental"}, "both"),
        ("legacy", {"OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_latest_experimental"}, "legacy"),
    ],
)
def test_the_mode_from_the_flag_else_the_opt_in_variable(flag, env, mode):
    assert resolve_semconv(flag, env) == mode


def test_each_mode_emits_its_names_and_an_unknown_mode_is_refused():
    emitted = {mode: {i.name for i in INSTRUMENTS if i.emitted(mode)} for mode in ("legacy", "latest", "both")}
    assert emitted == {"legacy": LEGACY, "latest": LATEST, "both": LEGACY | LATEST}
    with pytest.raises(ValueError, match="dup"):
        resolve_semconv("dup", {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_catalogue_and_the_latest_names_reach_a_real_receiver():
    receiver, m = OTLPReceiver(), Metrics("m")
    genai = GenAIMetrics(
        ["otlp"],
        "m",
        endpoint=receiver.endpoint + "/v1/metrics",
        interval_ms=600000,
        semconv="latest",
        catalogue=m,
        count_export=m.count_otlp_export,
    )
    try:
        for v in (0.003, 0.04, 0.04, 2.0):  # what RequestTelemetry.observe does: both, side by side
            m.ttft.labels("m", "/v1/chat/completions").observe(v)
            genai.mirror.observe(m.ttft, ("m", "/v1/chat/completions"), v)
        m.requests.labels("m", "stop", "200", "stop").inc(3)
        genai.record("chat", 1.0, ttft=0.1, input_tokens=7, output_tokens=3, cached_tokens=4)
        genai.record("chat", 0.01, input_tokens=0, error_type="invalid_json")
    finally:
        genai.shutdown()
        receiver.close()
    assert {p["name"] for p in receiver.points if p["name"].startswith("gen_ai.")} == LATEST
    assert {p["schema_url"] for p in receiver.points} == {SCHEMA_URL}
    (ttft,) = receiver.latest_points("sightline_time_to_first_token_seconds")
    assert ttft["kind"] == "exponential_histogram" and ttft["count"] == 4 and ttft["unit"] == "s"
    assert ttft["sum"] == pytest.approx(2.083) and sum(ttft["positive_counts"]) == 4
    (requests,) = [
        p
        for p in receiver.latest_points("sightline_requests")
        if p["attributes"]["outcome"] == "stop" and p["attributes"]["finish_reason"] == "stop"
    ]
    assert requests["kind"] == "sum" and requests["monotonic"] and requests["value"] == 3.0
    for name, counted in (("input_tokens", 7), ("output_tokens", 3), ("cache_read.input_tokens", 4)):
        usage = {
            p["attributes"]["gen_ai.token.modality"]: p["value"]
            for p in receiver.latest_points(f"gen_ai.client.inference.usage.{name}")
        }
        assert usage == {"text": counted, "unknown": 0}, name  # the refused request: 0, modality unknown
    assert m.otlp_exports.labels("ok")._value.get() == 1.0


def test_engine_histograms_keep_their_prometheus_buckets():
    from prometheus_client import Histogram

    from telemetry.otlp_catalogue import registry_metrics

    m = Metrics("m")
    h = Histogram("sightline_test_seconds", "a test", ["phase"], registry=m.registry, buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.7, 3.0):
        h.labels("forward").observe(v)
    (metric,) = [x for x in registry_metrics(m.registry, frozenset(), 0) if x.name == "sightline_test_seconds"]
    (point,) = metric.data.data_points
    assert (point.explicit_bounds, point.bucket_counts, point.count, point.sum) == ([0.1, 1.0], [1, 2, 1], 4, 4.25)
    assert metric.unit == "s" and point.attributes == {"phase": "forward"}
    mirrored = {x.name for x in registry_metrics(m.registry, frozenset(h._name for h in m.histograms()), 0)}
    assert "sightline_time_to_first_token_seconds" not in mirrored and "sightline_requests" in mirrored


def test_a_failed_export_is_counted(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "0.5")  # seconds the exporter retries an export
    m = Metrics("m")
    genai = GenAIMetrics(
        ["otlp"],
        "m",
        endpoint=f"http://127.0.0.1:{_free_port()}/v1/metrics",
        interval_ms=100,
        catalogue=m,
        count_export=m.count_otlp_export,
    )
    try:
        genai.record("chat", 0.5, ttft=0.1, input_tokens=3, output_tokens=2)
        wait_until(lambda: m.otlp_exports.labels("failed")._value.get() >= 1, 10, "a failed export counted")
    finally:
        genai.shutdown(timeout_ms=1000)
    assert m.otlp_exports.labels("ok")._value.get() == 0
