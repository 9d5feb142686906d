"""Exporter and sampling configuration from the standard OTEL_* variables: OTLP/gRPC,
console, and parent-based ratio sampling (ratio 0: only requests that arrive sampled)."""

from __future__ import annotations

import pytest

from tests.otlp_receiver import OTLPReceiver
from tests.server_util import ServerProc

INCOMING = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def grpc_otlp():
    r = OTLPReceiver(grpc=True)
    yield r
    r.close()


def test_grpc_and_console_from_env_with_ratio_zero(tmp_path, grpc_otlp):
    env = {
        "OTEL_TRACES_EXPORTER": "otlp,console",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": grpc_otlp.grpc_endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    srv = ServerProc(tmpdir=tmp_path, env=env)
    try:
        plain = srv.post("/v1/completions", {"prompt": "not sampled", "max_tokens": 3})
        assert plain.status_code == 200 and int(plain.headers["traceparent"][-2:], 16) & 1 == 0  # not sampled
        assert "trace_id" not in plain.json()["sightline"]  # recorded for tail sampling, which dropped it
        traced = srv.post(
            "/v1/completions", {"prompt": "sampled upstream", "max_tokens": 3}, headers={"traceparent": INCOMING}
        )
        trace_id = INCOMING.split("-")[1]
        assert traced.json()["sightline"]["trace_id"] == trace_id
        spans = grpc_otlp.wait_for(lambda s: s["trace_id"] == trace_id and s["name"] == "decode", timeout=15)
        assert spans and spans[0]["resource"]["sightline.process.role"] == "scheduler"
        assert {s["trace_id"] for s in grpc_otlp.spans if s["name"] != "forward"} == {trace_id}
        # the batch span over the sampled request is kept, linked to it, though new roots get ratio 0
        forwards = grpc_otlp.wait_for(lambda s: s["name"] == "forward" and any(l[0] == trace_id for l in s["links"]))
        assert forwards
    finally:
        srv.stop()
    assert f'"trace_id": "0x{trace_id}"' in srv.log(), "the console exporter printed no span"


def test_an_otlp_endpoint_alone_in_the_environment_exports_otlp(tmp_path, monkeypatch):
    """No exporter chosen by flag or OTEL_TRACES_EXPORTER: the SDKs' default, otlp, to that endpoint."""
    for name in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_SDK_DISABLED",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_SERVICE_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    receiver = OTLPReceiver()
    srv = ServerProc(
        tmpdir=tmp_path, env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    )
    try:
        r = srv.post("/v1/completions", {"prompt": "to the collector", "max_tokens": 3})
        trace_id = r.json()["sightline"]["trace_id"]
        spans = receiver.wait_for(lambda s: s["trace_id"] == trace_id and s["name"] == "decode", timeout=15)
        assert spans and spans[0]["resource"]["service.name"] == "sightline"
        server = receiver.wait_for(lambda s: s["trace_id"] == trace_id and s["kind"] == "SERVER")
        assert server and server[0]["resource"]["sightline.process.role"] == "main"
    finally:
        srv.stop()
        receiver.close()
