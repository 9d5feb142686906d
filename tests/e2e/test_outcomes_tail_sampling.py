"""One outcome per request, and tail sampling, on one real server with head sampling at 0.

Each outcome is driven for real (a stop string, max_tokens, a bad body, an injected engine
error, a 429 while a held stream holds the token budget, a request queued behind it past
the TTFT threshold, a client that leaves, a deadline, a killed Scheduler and a request
arriving while the engine restarts). Then `sightline_requests_total` summed by outcome
equals the requests sent exactly, and the OTLP receiver holds the complete trace (spans
of every process) of each request tail sampling kept, and nothing of the ones it dropped.
The streams that must be running when their client leaves, their deadline passes or the
Scheduler dies are held one token short of their end (tests.server_util.HOLD).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import pytest

from serving.args import ServerArgs
from tests.server_util import HOLD, ServerProc, value, wait_until

FAULT_SEED = 4242
LONG = 32  # tokens of the held streams: they stream 31, then run on until cut
SHED = 40  # tokens a request asks for that is shed beside a held stream
# the front end charges a request what the Scheduler first expects it to need (prompt + 0.7 x max_tokens): one
# held stream fits in the token budget, beside a 4-token request too (at most 7 more), not beside a SHED-token
# one (at least 29 more)
BUDGET = ServerArgs().expected_tokens(4, LONG) + 20
TTFT_MS = 500


@pytest.fixture(scope="module")
def srv(otlp, tmp_path_factory):
    s = ServerProc(
        "--otel-traces-exporter",
        "otlp",
        "--otel-exporter-otlp-endpoint",
        otlp.endpoint,
        "--otel-sampling-ratio",
        "0",
        "--tail-sampling-ttft-ms",
        str(TTFT_MS),
        "--tail-sampling-tpot-ms",
        "0",
        "--max-running-requests",
        "1",
        "--max-inflight-tokens",
        str(BUDGET),
        "--startup-timeout",
        "120",
        tmpdir=tmp_path_factory.mktemp("outcomes"),
        env={"SIGHTLINE_FAULT_SEED": str(FAULT_SEED), "OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    yield s
    s.stop()


def trace_of(resp: httpx.Response) -> str:
    return resp.headers["traceparent"].split("-")[1]


def held_stream(srv: ServerProc) -> contextlib.AbstractContextManager[httpx.Response]:
    """A streamed completion of LONG tokens, held before its last; leaving the block disconnects."""
    body = {"prompt": "long", "max_tokens": LONG, "stream": True, **HOLD}
    return httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120)


def test_every_outcome_is_counted_once_and_tail_sampling_keeps_the_bad_ones(srv, otlp):
    def roles(trace_id: str) -> set[str]:
        return {s["resource"]["sightline.process.role"] for s in otlp.trace(trace_id)}

    post = lambda body, **kw: srv.post("/v1/completions", {"prompt": "hello there", **body}, **kw)  # noqa: E731
    sent, traces = 0, {}

    r = post({"max_tokens": 8, "temperature": 0})  # length
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    text, traces["length"] = r.json()["choices"][0]["text"], trace_of(r)
    stop = text[len(text) // 2 :][:3] or text
    r = post({"max_tokens": 8, "temperature": 0, "stop": [stop]})  # stop
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    traces["stop"] = trace_of(r)
    r = post({"max_tokens": -1})  # rejected
    assert r.status_code == 400
    traces["rejected"] = trace_of(r)
    r = post({"max_tokens": 8, "seed": FAULT_SEED})  # error
    assert r.status_code == 500, r.text
    traces["error"] = trace_of(r)
    sent += 4

    queued: dict = {}
    with held_stream(srv) as long:
        assert long.status_code == 200
        traces["client_disconnect"] = trace_of(long)
        srv.wait_held(1)
        r = post({"max_tokens": SHED})  # shed: its budget does not fit beside the held stream's
        assert r.status_code == 429, r.text
        traces["shed"] = trace_of(r)
        waiter = threading.Thread(target=lambda: queued.setdefault("r", post({"max_tokens": 4})), daemon=True)
        waiter.start()  # admitted, but --max-running-requests 1: it waits for the held stream
        wait_until(lambda: srv.barrier() or srv.debug()["scheduler"]["num_waiting"] == 1, 30, "it waits")
        time.sleep(TTFT_MS / 1000 * 2)  # clock: its wait passes the TTFT threshold
    # leaving the block disconnected the held stream: client_disconnect
    waiter.join(60)
    assert queued["r"].status_code == 200
    traces["ttft"] = trace_of(queued["r"])
    assert queued["r"].json()["sightline"]["ttft_ms"] > TTFT_MS
    r = post({"max_tokens": LONG, **HOLD}, headers={"x-request-timeout": "0.3"})  # timeout, held until then
    assert r.status_code == 504, r.text
    traces["timeout"] = trace_of(r)
    sent += 4

    # before the Scheduler is killed below (it and the Detokenizer forward their spans with their stats):
    # the requests that reached the engine are exported with the spans of every process
    everywhere = {"main", "scheduler", "detokenizer"}
    for outcome in ("error", "client_disconnect", "ttft", "timeout"):
        wait_until(
            lambda: roles(traces[outcome]) == everywhere, 20, f"the {outcome} request's trace from every process"
        )

    with held_stream(srv) as doomed:
        traces["engine_failure"] = trace_of(doomed)
        srv.wait_held(1)
        os.kill(srv.debug()["pids"]["scheduler"], signal.SIGKILL)  # engine_failure
        error_events = [line for line in doomed.iter_lines() if '"error"' in line]
    assert len(error_events) == 1 and "server_unavailable" in error_events[0], error_events
    r = post({"max_tokens": 4})  # unavailable: the engine is restarting
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    traces["unavailable"] = trace_of(r)
    sent += 2
    wait_until(lambda: httpx.get(srv.url + "/health", timeout=5).status_code == 200, 120, "the engine restarted")

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    by_outcome = {
        o: value(text, "sightline_requests_total", outcome=o)
        for o in (
            "stop",
            "length",
            "rejected",
            "shed",
            "unavailable",
            "client_disconnect",
            "timeout",
            "error",
            "engine_failure",
            "shutdown",
            "aborted_by_operator",
        )
    }
    assert by_outcome == {
        "stop": 1,
        "length": 2,
        "rejected": 1,
        "shed": 1,
        "unavailable": 1,
        "client_disconnect": 1,
        "timeout": 1,
        "error": 1,
        "engine_failure": 1,
        "shutdown": 0,
        "aborted_by_operator": 0,
    }
    assert value(text, "sightline_requests_total") == sent == 10  # exactly one outcome each

    kept = {
        r: value(text, "sightline_tail_sampling_traces_total", decision="kept", reason=r)
        for r in ("error", "aborted", "shed", "ttft", "tpot")
    }
    assert kept == {"error": 3, "aborted": 2, "shed": 1, "ttft": 1, "tpot": 0}  # error + engine_failure + unavailable
    assert value(text, "sightline_tail_sampling_traces_total", decision="dropped", reason="not_selected") == 3
    assert value(text, "sightline_tail_sampling_traces_total", decision="dropped", reason="buffer_full") == 0

    for outcome in ("shed", "unavailable", "engine_failure"):  # the front end's spans (the killed Scheduler's are lost)
        wait_until(lambda: "main" in roles(traces[outcome]), 20, f"the {outcome} request's trace")
    server_span = next(s for s in otlp.trace(traces["ttft"]) if s["kind"] == "SERVER")
    assert server_span["attributes"]["sightline.tail_sampling.reason"] == "ttft"
    assert server_span["resource"]["service.name"] == "sightline"
    error_span = next(s for s in otlp.trace(traces["error"]) if s["kind"] == "SERVER")
    assert error_span["status"] == 2 and error_span["attributes"]["error.type"]  # STATUS_CODE_ERROR
    # nothing of the dropped ones: the front end exports every kept trace through one queue, in the order
    # decided, and the kept ones awaited above were decided after them (their spans from the children too)
    for outcome in ("length", "stop", "rejected"):
        assert otlp.trace(traces[outcome]) == [], f"the {outcome} request's trace was exported"


def test_a_callers_unsampled_choice_is_respected(srv, otlp):
    """sampled=0 from the caller: nothing is recorded, so even a failure exports nothing.  A failure after it
    that tail sampling keeps goes out through the same export queue: once its trace is in, the first one's
    would be too."""
    trace_id = "ab" * 16

    def total():
        return value(httpx.get(srv.url + "/metrics", timeout=10).text, "sightline_tail_sampling_traces_total")

    srv.barrier()
    before = total()
    r = srv.post(
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4, "seed": FAULT_SEED},
        headers={"traceparent": f"00-{trace_id}-{'cd' * 8}-00"},
    )
    assert r.status_code == 500
    marker = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "seed": FAULT_SEED})
    assert marker.status_code == 500
    srv.barrier()  # the children's spans of both are with the front end, which decided both
    wait_until(
        lambda: (
            {s["resource"]["sightline.process.role"] for s in otlp.trace(trace_of(marker))}
            == {"main", "scheduler", "detokenizer"}
        ),
        20,
        "the later failure's trace from every process",
    )
    assert otlp.trace(trace_id) == []
    assert total() == before + 1  # the later failure's decision only
