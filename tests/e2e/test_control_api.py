"""The control API on one real server: every pause mode keeps its promise, the watchdog leaves a
paused engine alone, runtime tracing changes take effect, and every request sent is counted.

One tiny-random server with a short watchdog and stall timeout (a paused engine with requests
in flight must be neither restarted nor reported stuck).  The requests a pause must find running
are held (tests.server_util.HOLD) until the pause has landed.  The tests run in file order and
share the tally of what each request they sent must be counted as.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from tests.server_util import HOLD, ServerProc, Stream, samples, scrape, wait_until

WATCHDOG = 3.0
TALLY: Counter = Counter()  # outcome -> requests sent by these tests that must end with it
PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
HELD = {**PARAMS, **HOLD}  # held one token short of max_new_tokens until released or cut


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(
        "--watchdog-timeout",
        str(WATCHDOG),
        "--stall-timeout",
        "2",
        "--heartbeat-interval",
        "0.2",
        tmpdir=tmp_path_factory.mktemp("control"),
    )
    yield srv
    srv.stop()


def control(srv: ServerProc, path: str, body: dict | None = None) -> httpx.Response:
    return srv.post(path, body or {}, timeout=30)


def outcomes(srv: ServerProc) -> Counter:
    return Counter(
        {s.labels["outcome"]: s.value for s in samples(scrape(srv)) if s.name == "sightline_requests_total" and s.value}
    )


def generate(srv: ServerProc, prompt: str, n: int) -> httpx.Response:
    return srv.post("/generate", {"text": prompt, "sampling_params": {**PARAMS, "max_new_tokens": n}})


def assert_paused_refusals(srv: ServerProc) -> None:
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and health.json()["reason"] == "paused", health.text
    r = generate(srv, "refused while paused", 4)
    TALLY["unavailable"] += 1
    assert r.status_code == 503 and r.json()["error"]["code"] == "paused", r.text
    assert int(r.headers["retry-after"]) > 0


def test_abort_ends_every_request_in_flight_with_an_explicit_error(server):
    streams = [Stream(server, f"abort me {i}", HELD) for i in range(3)]
    server.wait_held(3)
    r = control(server, "/pause_generation", {"mode": "abort"})
    assert r.status_code == 200 and r.json()["aborted"] == 3 and r.json()["in_flight"] == 0, r.text
    for s in streams:
        s.join(30)
        *_, err, done = s.events
        assert s.status == 200 and done == "[DONE]" and "aborted by an operator" in err["error"]["message"], err
        assert len(s.tokens()) == HELD["max_new_tokens"] - 1  # cut while held
    TALLY["aborted_by_operator"] += 3
    assert_paused_refusals(server)
    assert server.debug()["paused"] == "abort"
    server.barrier()  # the aborts have reached the Scheduler, its stats are in
    state = server.debug()["scheduler"]
    assert state["num_running"] == 0 and state["held"] == 0, state
    assert control(server, "/continue_generation").json()["resumed"] == "abort"
    assert httpx.get(server.url + "/health").status_code == 200


def test_in_place_keeps_requests_and_kv_and_resumes_with_the_same_tokens(server):
    """A held stream is paused in place, then released: the paused Scheduler does not step it, the
    watchdog leaves it alone, and after the resume it ends with the tokens of an uninterrupted run."""
    prompt, params = "Once upon a time", {**PARAMS, "max_new_tokens": 24}
    assert server.post("/flush_cache", {}).status_code == 200
    ref = Stream(server, prompt, params)
    ref.join(120)
    TALLY["length"] += 1
    assert len(ref.tokens()) == params["max_new_tokens"]
    failures_before = [s.value for s in samples(scrape(server)) if s.name == "sightline_engine_failures_total"]
    pids = server.debug()["pids"]

    assert server.post("/flush_cache", {}).status_code == 200
    s = Stream(server, prompt, {**params, **HOLD})
    server.wait_held(1)
    r = control(server, "/pause_generation", {"mode": "in_place"})
    assert r.status_code == 200 and r.json()["in_flight"] == 1, r.text
    paused_at = time.monotonic()
    server.release()  # free to step again, but paused: the Scheduler must not step it
    server.wait_held(0)  # the release is handled ...
    server.barrier()  # ... and the output of a step after it would have reached the front end
    wait_until(lambda: len(s.tokens()) == params["max_new_tokens"] - 1, 10, "the held tokens at the client")
    seen, before = len(s.events), server.debug()["scheduler"]
    assert s.tokens() == ref.tokens()[:-1] and before["held"] == 0 and before["num_running"] == 1, before
    assert_paused_refusals(server)
    # the watchdog: requests in flight, no token for longer than --watchdog-timeout and --stall-timeout
    time.sleep(max(0.0, paused_at + WATCHDOG + 1.0 - time.monotonic()))  # clock: past --watchdog-timeout
    server.barrier()
    after = server.debug()["scheduler"]
    assert len(s.events) == seen, "tokens arrived while paused in place"
    assert after["paused"] and after["num_running"] == 1 and after["held"] == 0
    assert (after["kv_used"], after["kv_reserved"], after["generation_tokens_total"]) == (
        before["kv_used"],
        before["kv_reserved"],
        before["generation_tokens_total"],
    )
    assert httpx.get(server.url + "/health").json()["reason"] == "paused"
    assert server.debug()["pids"] == pids and s.is_alive()

    r = control(server, "/continue_generation")
    assert r.status_code == 200 and r.json()["resumed"] == "in_place", r.text
    assert httpx.get(server.url + "/health").status_code == 200  # the stall clock restarted at the resume
    s.join(120)
    TALLY["length"] += 1
    assert s.events[-1] == "[DONE]" and s.tokens() == ref.tokens()
    assert [s.value for s in samples(scrape(server)) if s.name == "sightline_engine_failures_total"] == failures_before


def test_drain_lets_running_requests_finish_and_refuses_new_ones(server):
    s = Stream(server, "drain me", HELD)
    server.wait_held(1)
    r = control(server, "/pause_generation", {"mode": "drain"})
    assert r.status_code == 200 and r.json()["in_flight"] == 1, r.text
    assert_paused_refusals(server)
    assert server.held() == 1 and s.is_alive()  # the drain leaves it running
    server.release()
    s.join(120)
    TALLY["length"] += 1
    assert s.events[-1] == "[DONE]" and len(s.tokens()) == HELD["max_new_tokens"]
    assert control(server, "/continue_generation").json()["resumed"] == "drain"
    assert httpx.get(server.url + "/health").status_code == 200


def test_runtime_sampling_ratio_and_log_level(server):
    def flags() -> str:
        r = generate(server, "trace me", 2)
        TALLY["length"] += 1
        assert r.status_code == 200, r.text
        return int(r.headers["traceparent"][-2:], 16) & 1  # the W3C sampled flag

    assert control(server, "/control/tracing", {"sampling_ratio": 0.0}).json()["sampling_ratio"] == 0.0
    assert flags() == 0
    assert control(server, "/control/tracing", {"sampling_ratio": 1.0}).json()["previous"] == 0.0
    assert flags() == 1
    assert control(server, "/control/tracing", {"sampling_ratio": 2}).status_code == 400
    assert control(server, "/pause_generation", {"mode": "sideways"}).status_code == 400
    r = control(server, "/control/log_level", {"level": "debug"})
    assert r.status_code == 200 and r.json()["previous"] == "info", r.text
    control(server, "/control/log_level", {"level": "info"})
    cfg = httpx.get(server.url + "/control/config").json()
    assert cfg["runtime"] == {"paused": None, "sampling_ratio": 1.0, "log_level": "info", "tokenizer_worker": None}
    assert cfg["args"]["watchdog_timeout"] == WATCHDOG and cfg["args"]["api_key"] is None


def test_every_action_logged_and_counted_and_no_request_lost(server):
    text = scrape(server)
    got = {
        (s.labels["action"], s.labels["result"]): s.value
        for s in samples(text)
        if s.name == "sightline_control_actions_total"
    }
    for action in ("pause_abort", "pause_in_place", "pause_drain"):
        assert got[(action, "ok")] == 1, got
    assert got[("continue", "ok")] == 3 and got[("tracing", "ok")] == 2 and got[("tracing", "rejected")] == 1
    assert got[("log_level", "ok")] == 2
    assert {s.labels["mode"]: s.value for s in samples(text) if s.name == "sightline_paused"} == {
        "abort": 0,
        "in_place": 0,
        "drain": 0,
    }
    assert outcomes(server) == TALLY  # exactly one outcome for every request sent, nothing else
    log = server.log()
    for action in ("pause_abort", "pause_in_place", "pause_drain", "continue", "tracing", "log_level"):
        assert f"control {action} by 127.0.0.1: ok" in log, action
