"""Per-request latency objectives on a real server: objectives from llm-d's headers (and their
aliases) or from the tenant's keys-file defaults, judged at each request's end; the verdict in
the response, `sightline_request_slo_total{slo,met,tenant}` counting exactly what was sent, tail
sampling keeping the whole trace of every request that missed (head sampling at 0, the global
TTFT/TPOT thresholds off), streamed requests' `gen_ai.response.time_to_first_chunk` and the
spans' schema URL, exemplars with their timestamps, and a malformed header refused with a 400
that names it while the server keeps serving."""

from __future__ import annotations

import time

import httpx
import pytest

from telemetry.genai_instruments import SCHEMA_URL
from tests.server_util import ServerProc, scrape, sse_events, value, wait_until

ADMIN = "sk-slo-admin-0123456789abcdef"  # --api-key: tenant default, admin (the test harness's /debug)
KEY_A, KEY_B = "sk-slo-tenant-a-0123456789", "sk-slo-tenant-b-0123456789"
KEYS = f"""keys = [{{tenant = "a", key = "{KEY_A}"}}, {{tenant = "b", key = "{KEY_B}"}}]

[tenants.a]
slo_e2e_ms = 60000
"""
EASY = "60000"  # ms: met by any request that succeeds here
TIGHT = "0.001"  # ms: missed by every request
SLO = "sightline_request_slo_total"


@pytest.fixture(scope="module")
def srv(otlp, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    keys.chmod(0o600)
    s = ServerProc(
        "--api-keys-file",
        str(keys),
        "--otel-traces-exporter",
        "otlp",
        "--otel-exporter-otlp-endpoint",
        otlp.endpoint,
        "--otel-sampling-ratio",
        "0",
        "--tail-sampling-ttft-ms",
        "0",
        "--tail-sampling-tpot-ms",
        "0",
        tmpdir=tmp_path_factory.mktemp("slo"),
        env={"OTEL_BSP_SCHEDULE_DELAY": "100", "SIGHTLINE_API_KEY": ADMIN},
    )
    yield s
    s.stop()


def _post(srv: ServerProc, key: str, headers: dict[str, str], **body) -> httpx.Response:
    return srv.post(
        "/v1/completions",
        {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True, **body},
        headers={"authorization": f"Bearer {key}", **headers},
    )


def _trace(r: httpx.Response) -> str:
    return r.headers["traceparent"].split("-")[1]


def test_objectives_judged_counted_and_missed_traces_kept(srv, otlp):
    t0 = time.time()
    ok = _post(srv, KEY_B, {"x-llm-d-slo-ttft-ms": EASY, "x-llm-d-slo-tpot-ms": EASY, "x-sightline-slo-e2e-ms": EASY})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 4
    assert ok.json()["sightline"]["slo"] == {"ttft": True, "tpot": True, "e2e": True, "all": True}

    missed = _post(srv, KEY_B, {"x-llm-d-slo-ttft-ms": TIGHT, "x-llm-d-slo-tpot-ms": EASY})
    assert missed.status_code == 200 and missed.json()["sightline"]["slo"] == {
        "ttft": False,
        "tpot": True,
        "all": False,
    }, missed.text

    # tenant a: no header, its keys-file e2e objective; then the aliases over it (the canonical name wins)
    tenant = _post(srv, KEY_A, {})
    assert tenant.json()["sightline"]["slo"] == {"e2e": True, "all": True}, tenant.text
    alias = _post(srv, KEY_A, {"x-slo-ttft-ms": TIGHT, "x-slo-tpot-ms": TIGHT, "x-llm-d-slo-tpot-ms": EASY})
    assert alias.json()["sightline"]["slo"] == {"ttft": False, "tpot": True, "e2e": True, "all": False}, alias.text

    # a request refused before the engine meets no objective
    refused = _post(srv, KEY_B, {"x-sightline-slo-e2e-ms": EASY}, max_tokens=-1)
    assert refused.status_code == 400

    # a malformed objective: 400 naming the header; nothing counted; the server keeps serving
    for header, raw in (("x-llm-d-slo-tpot-ms", "fast"), ("x-slo-ttft-ms", "-5"), ("x-sightline-slo-e2e-ms", "nan")):
        bad = _post(srv, KEY_B, {header: raw})
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == header and header in err["message"] and err["code"] == "invalid_slo_header", err

    # a streamed chat that misses: its trace is kept, with the time to first chunk on the server span
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        srv.url + "/v1/chat/completions",
        json=body,
        timeout=60,
        headers={"authorization": f"Bearer {KEY_B}", "x-llm-d-slo-ttft-ms": TIGHT},
    ) as r:
        assert r.status_code == 200
        streamed_trace = _trace(r)
        events = sse_events(r.iter_lines())
    assert events[-2]["sightline"]["slo"] == {"ttft": False, "all": False}, events[-2]
    t1 = time.time()

    text = scrape(srv)
    expected = {
        ("ttft", "true", "b"): 1,
        ("ttft", "false", "b"): 2,
        ("tpot", "true", "b"): 2,
        ("e2e", "true", "b"): 1,
        ("e2e", "false", "b"): 1,
        ("all", "true", "b"): 1,
        ("all", "false", "b"): 3,
        ("ttft", "false", "a"): 1,
        ("tpot", "true", "a"): 1,
        ("e2e", "true", "a"): 2,
        ("all", "true", "a"): 1,
        ("all", "false", "a"): 1,
    }
    for slo in ("ttft", "tpot", "e2e", "all"):
        for met in ("true", "false"):
            for t in ("a", "b"):
                got = value(text, SLO, slo=slo, met=met, tenant=t)
                assert got == expected.get((slo, met, t), 0), (slo, met, t, got)
    # the four requests that missed were kept (reason slo); the rest dropped, the malformed ones unjudged
    assert value(text, "sightline_tail_sampling_traces_total", decision="kept", reason="slo") == 4
    assert value(text, "sightline_tail_sampling_traces_total", decision="kept", reason="ttft") == 0

    kept = {_trace(missed): ["ttft"], _trace(alias): ["ttft"], _trace(refused): ["e2e"], streamed_trace: ["ttft"]}
    for tid, why in kept.items():
        spans = wait_until(
            lambda tid=tid: [s for s in otlp.trace(tid) if s["kind"] == "SERVER"], 15, f"the kept trace {tid}"
        )
        attrs = spans[0]["attributes"]
        assert attrs["sightline.tail_sampling.reason"] == "slo" and attrs["sightline.slo.missed"] == why, attrs
        assert spans[0]["schema_url"] == SCHEMA_URL
        if tid != _trace(refused):  # the others ran in the engine: its spans are in the trace too
            wait_until(
                lambda tid=tid: (
                    {"main", "scheduler"} <= {s["resource"]["sightline.process.role"] for s in otlp.trace(tid)}
                ),
                15,
                "the engine's spans",
            )
    stream_span = next(s for s in otlp.trace(streamed_trace) if s["kind"] == "SERVER")
    first_chunk = stream_span["attributes"]["gen_ai.response.time_to_first_chunk"]
    assert 0 < first_chunk <= stream_span["attributes"]["gen_ai.latency.e2e"]
    for r in (ok, tenant):
        assert not otlp.trace(_trace(r)), "a request that met its objectives was exported"

    # the e2e histogram's exemplars name the kept traces, stamped when they were observed
    om = scrape(srv, openmetrics=True)
    stamped = [
        line
        for line in om.splitlines()
        if line.startswith("sightline_e2e_request_latency_seconds_bucket") and " # {" in line
    ]
    assert stamped, "no exemplar"
    for line in stamped:
        labels, _, rest = line.partition(" # ")
        trace_id = rest.split('trace_id="')[1].split('"')[0]
        stamp = float(rest.rsplit(" ", 1)[1])
        assert trace_id in kept and t0 <= stamp <= t1, line
