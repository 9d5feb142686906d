"""Telemetry end to end: spans from all three processes reach a real OTLP receiver, /metrics
adds up, exemplars point at real traces, stale drops are attributed to their request."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

from tests.server_util import HOLD, ServerProc, scrape, sse_events, value, wait_until

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
STAGES = {
    "tokenize",
    "send scheduler",
    "receive scheduler",
    "queue",
    "prefill",
    "decode",
    "send detokenizer",
    "receive detokenizer",
    "detokenize",
    "send tokenizer_manager",
    "receive tokenizer_manager",
    "stream",
}


@pytest.fixture(scope="module")
def server(otlp, tmp_path_factory):
    srv = ServerProc(
        "--otel-traces-exporter",
        "otlp",
        "--otel-exporter-otlp-endpoint",
        otlp.endpoint,
        tmpdir=tmp_path_factory.mktemp("telemetry"),
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    yield srv
    srv.stop()


def test_one_streaming_request_is_one_trace_across_three_processes(server, otlp):
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        events = sse_events(r.iter_lines())
        rid = r.headers["x-request-id"]
        assert r.headers["traceparent"].startswith(f"00-{PARENT_TRACE}-")
    breakdown = events[-2]["sightline"]
    assert breakdown["trace_id"] == PARENT_TRACE
    assert all(
        breakdown[k] is not None and breakdown[k] >= 0
        for k in ("ttft_ms", "queue_ms", "prefill_ms", "decode_ms", "tokenize_ms", "e2e_ms")
    )
    spans = wait_until(
        lambda: (got := otlp.trace(PARENT_TRACE)) and STAGES <= {s["name"] for s in got} and got,
        15,
        "the trace's spans at the receiver",
    )
    names = {s["name"] for s in spans}
    assert STAGES <= names, names
    roots = [s for s in spans if s["kind"] == "SERVER"]
    assert len(roots) == 1 and roots[0]["parent_span_id"] == PARENT_SPAN
    root = roots[0]
    assert root["attributes"]["gen_ai.operation.name"] == "chat"
    assert root["attributes"]["gen_ai.request.model"] == "tiny-random"
    assert root["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert root["attributes"]["gen_ai.response.id"] == rid
    stage_spans = [s for s in spans if s["name"] in STAGES]
    assert all(s["parent_span_id"] == root["span_id"] for s in stage_spans)
    roles = {s["resource"]["sightline.process.role"]: s["resource"]["process.pid"] for s in spans}
    assert set(roles) == {"main", "scheduler", "detokenizer"} and len(set(roles.values())) == 3
    by_name = {s["name"]: s for s in spans}
    for hop in ("receive scheduler", "receive detokenizer", "receive tokenizer_manager"):
        assert by_name[hop]["kind"] == "CONSUMER" and by_name[hop]["attributes"]["messaging.system"] == "zeromq"
        producers = {s["span_id"] for s in spans if s["kind"] == "PRODUCER"}
        assert {link[1] for link in by_name[hop]["links"]} <= producers and by_name[hop]["links"]
    assert by_name["decode"]["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert by_name["decode"]["attributes"]["sightline.decode.mean_itl_seconds"] > 0
    # the batch forward passes live in their own traces, linked to this request
    forwards = otlp.wait_for(lambda s: s["name"] == "forward" and any(l[0] == PARENT_TRACE for l in s["links"]))
    assert forwards and all(s["trace_id"] != PARENT_TRACE for s in forwards)
    # the same timeline, without any backend (children forward spans with their stats: the barrier's too)
    server.barrier()
    local = httpx.get(f"{server.url}/debug/requests/{rid}").json()
    assert {s["role"] for s in local["spans"]} == {"main", "scheduler", "detokenizer"}
    assert STAGES <= {s["name"] for s in local["spans"]}


def test_several_choices_are_one_trace_with_a_span_per_choice(server, otlp):
    trace = "5bf92f3577b34da6a3ce929d0e0e4737"
    headers = {"traceparent": f"00-{trace}-{PARENT_SPAN}-01"}
    body = {"prompt": "Hello there", "n": 3, "max_tokens": 2, "temperature": 0, "logprobs": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3

    def complete():
        got = otlp.trace(trace)
        names = [s["name"] for s in got]
        return (
            got
            if names.count("choice") == 3 and names.count("decode") == 3 and "POST /v1/completions" in names
            else None
        )

    spans = wait_until(complete, 15, "the spans of the three choices at the receiver")
    root = next(s for s in spans if s["kind"] == "SERVER")
    choices = [s for s in spans if s["name"] == "choice"]
    assert root["parent_span_id"] == PARENT_SPAN and all(c["parent_span_id"] == root["span_id"] for c in choices)
    assert sorted(c["attributes"]["sightline.choice.index"] for c in choices) == [0, 1, 2]
    rids = root["attributes"]["sightline.choice_rids"]
    assert len(set(rids)) == 3 and r.headers["x-request-id"] not in rids  # the HTTP request has its own id
    decodes = [s for s in spans if s["name"] == "decode"]  # each choice's engine stages hang under its own span
    assert {d["parent_span_id"] for d in decodes} == {c["span_id"] for c in choices}


def test_request_without_traceparent_starts_a_new_trace(server, otlp):
    r = server.post("/v1/completions", {"prompt": "new trace", "max_tokens": 2})
    tp = r.headers["traceparent"].split("-")
    assert r.json()["sightline"]["trace_id"] == tp[1] != PARENT_TRACE
    roots = otlp.wait_for(lambda s: s["trace_id"] == tp[1] and s["kind"] == "SERVER")
    assert roots and roots[0]["parent_span_id"] is None


def test_disconnect_counts_stale_drop_and_records_span_in_its_trace(server, otlp):
    """A held stream's client leaves: the front end forgets it and aborts it, and the Scheduler's answer to the
    abort (its last output) arrives for a request no one waits for any more: one stale drop, in its trace."""
    server.barrier()
    before = scrape(server)
    body = {"prompt": "a long story", "max_tokens": 8, "stream": True, **HOLD}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        trace_id = r.headers["traceparent"].split("-")[1]
        server.wait_held(1)
    aborts = {"name": "sightline_request_aborts_total", "reason": "client_disconnect"}
    wait_until(
        lambda: value(scrape(server), **aborts) == value(before, **aborts) + 1,
        10,
        "the front end to see the client leave",
    )
    server.barrier()  # its abort has reached the Scheduler, and the Scheduler's answer the front end
    stale = {
        "name": "sightline_stale_messages_dropped_total",
        "component": "tokenizer_manager",
        "reason": "client_disconnect",
    }
    assert value(scrape(server), **stale) == value(before, **stale) + 1
    drops = otlp.wait_for(lambda s: s["trace_id"] == trace_id and s["name"] == "stale_message_dropped")
    assert len(drops) == 1 and drops[0]["attributes"]["sightline.drop.reason"] == "client_disconnect"
    root = otlp.wait_for(lambda s: s["trace_id"] == trace_id and s["kind"] == "SERVER")
    assert root[0]["attributes"]["error.type"] == "client_disconnect"


def test_metrics_add_up_and_exemplars_are_real_traces(tmp_path, otlp):
    srv = ServerProc(
        "--otel-traces-exporter",
        "otlp",
        "--otel-exporter-otlp-endpoint",
        otlp.endpoint,
        tmpdir=tmp_path,
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    try:
        usage, reasons = [], {}
        for i in range(8):
            body = {"prompt": f"count {i}", "max_tokens": 3 + i, "temperature": 0}
            if i % 3 == 0:
                body["stop"] = [" "]  # most likely ends early with finish_reason stop
            if i % 2:
                body["stream"], body["stream_options"] = True, {"include_usage": True}
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                    ev = sse_events(r.iter_lines())
                usage.append(ev[-2]["usage"])
                reason = [e["choices"][0]["finish_reason"] for e in ev[:-2] if e["choices"]][-1]
            else:
                out = srv.post("/v1/completions", body).json()
                usage.append(out["usage"])
                reason = out["choices"][0]["finish_reason"]
            reasons[reason] = reasons.get(reason, 0) + 1
        assert srv.post("/v1/completions", {"prompt": ""}).status_code == 400
        srv.barrier()  # the engine's counts of those requests are in
        text = scrape(srv)
        for h in (
            "sightline_time_to_first_token_seconds",
            "sightline_e2e_request_latency_seconds",
            "sightline_request_queue_time_seconds",
            "sightline_request_tokenize_time_seconds",
        ):
            assert value(text, h + "_count") == 8, h
        assert value(text, "sightline_generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
        assert value(text, "sightline_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
        for reason, n in reasons.items():
            assert value(text, "sightline_requests_total", finish_reason=reason, status="200") == n
        assert value(text, "sightline_requests_total", finish_reason="error", status="400") == 1
        assert value(text, "sightline_inter_token_latency_seconds_count") == sum(
            u["completion_tokens"] - 1 for u in usage
        )
        om = scrape(srv, openmetrics=True)
        exemplars = {
            s.exemplar.labels["trace_id"] for fam in openmetrics_families(om) for s in fam.samples if s.exemplar
        }
        assert exemplars
        for tid in exemplars:
            assert otlp.wait_for(lambda s, t=tid: s["trace_id"] == t and s["kind"] == "SERVER"), tid
        assert "sightline_kv_slots_capacity" in text and "sightline_process_resident_memory_bytes" in text
    finally:
        srv.stop()
    logs = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    finished = [entry for entry in logs if entry["msg"] == "request finished"]
    assert len(finished) == 9 - 1  # the rejected request never reached the TM
    assert all(entry["rid"] and entry["trace_id"] and "ttft_ms" in entry for entry in finished)
    assert not any("count 1" in line for line in srv.log().splitlines())  # prompts are not logged


def test_promtool_accepts_the_exposition(server):
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required under CI=true (Debian package `prometheus`; `make test` installs it)")
        pytest.skip("promtool not installed: install the Debian package `prometheus` (make test does, as root)")
    server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    res = subprocess.run([promtool, "check", "metrics"], input=scrape(server), capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_metrics_reference_is_generated_from_the_code():
    res = subprocess.run([os.sys.executable, "-m", "telemetry.metrics_doc", "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
