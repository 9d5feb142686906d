"""Fault injection under load: kill -9 / SIGSTOP the engine processes while streams run.

Every stream must end with an explicit error (SSE error event, then [DONE]) within 2 s
of the kill, and the server must be healthy and serving again within the restart
budget (RESTART_BUDGET_S: spawning both children and loading tiny-random).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_util import ServerProc, scrape, sse_events, value

RESTART_BUDGET_S = 30.0
STREAMS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc("--watchdog-timeout", "1.5", tmpdir=tmp_path_factory.mktemp("faults"))
    yield srv
    srv.stop()


class Streams:
    """N long streams in threads; records when each ended and how."""

    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.ended: dict[int, float] = {}
        self.events: dict[int, list] = {}
        self.started = threading.Barrier(n + 1, timeout=60)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()
        self.started.wait()

    def _run(self, i: int) -> None:
        body = {"prompt": f"story {i}", "max_tokens": 1800, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                first = True
                for line in r.iter_lines():
                    lines.append(line)
                    if first and line.startswith("data: "):
                        first = False
                        self.started.wait()
        finally:
            self.ended[i] = time.monotonic()
            self.events[i] = sse_events(lines)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


def wait_healthy(srv: ServerProc, since: float) -> float:
    while time.monotonic() - since < RESTART_BUDGET_S:
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not healthy within {RESTART_BUDGET_S} s:\n{srv.log()[-3000:]}")


def inject(srv: ServerProc, role: str, sig: int) -> tuple[Streams, float]:
    pid = srv.debug()["pids"][role]
    streams = Streams(srv.url, STREAMS)
    t0 = time.monotonic()
    os.kill(pid, sig)
    streams.join(30)
    return streams, t0


def check_explicit_errors(streams: Streams, t0: float, within: float) -> None:
    assert len(streams.ended) == STREAMS, "a stream hung"
    for i, events in streams.events.items():
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]["error"]
        assert err["type"] == "server_unavailable" and "engine failed" in err["message"]
        assert streams.ended[i] - t0 < within, f"stream {i} ended {streams.ended[i] - t0:.2f} s after the fault"


@pytest.mark.parametrize("role", ["scheduler", "detokenizer"])
def test_kill_9_a_child_under_load(server, role):
    before = value(scrape(server), "sightline_engine_failures_total", role=role, cause="exited")
    streams, t0 = inject(server, role, signal.SIGKILL)
    check_explicit_errors(streams, t0, within=2.0)
    restart_s = wait_healthy(server, t0)
    r = server.post("/v1/completions", {"prompt": "after the crash", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    text = scrape(server)
    assert value(text, "sightline_engine_failures_total", role=role, cause="exited") == before + 1
    assert value(text, "sightline_requests_total", finish_reason="abort", status="503") >= STREAMS
    assert f'"role": "{role}"' in server.log() and "engine failure" in server.log()
    print(f"{role} killed: streams failed within 2 s, healthy again after {restart_s:.1f} s")


def test_sigstop_scheduler_is_detected_as_a_stall_and_recovered(server):
    pid = server.debug()["pids"]["scheduler"]
    streams, t0 = inject(server, "scheduler", signal.SIGSTOP)
    try:
        # detection takes the watchdog timeout (1.5 s) plus one check
        check_explicit_errors(streams, t0, within=1.5 + 2.0)
        restart_s = wait_healthy(server, t0)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # if the restart did not already SIGKILL it
        except ProcessLookupError:
            pass
    assert server.debug()["pids"]["scheduler"] != pid
    assert value(scrape(server), "sightline_engine_failures_total", role="scheduler", cause="stalled") == 1
    assert server.post("/v1/completions", {"prompt": "after the stall", "max_tokens": 3}).status_code == 200
    print(f"scheduler stopped: detected and healthy again after {restart_s:.1f} s")


def test_exit_policy_stops_the_server(tmp_path):
    srv = ServerProc("--on-engine-failure", "exit", tmpdir=tmp_path)
    os.kill(srv.debug()["pids"]["scheduler"], signal.SIGKILL)
    assert srv.proc.wait(30) == 1
    assert not srv.runtime_dir.exists()


def test_health_fails_while_the_engine_is_stuck_and_sigcont_recovers(tmp_path):
    srv = ServerProc("--stall-timeout", "1", "--watchdog-timeout", "120", tmpdir=tmp_path)
    try:
        pid = srv.debug()["pids"]["scheduler"]
        done: list = []
        t = threading.Thread(target=lambda: done.append(srv.post("/v1/completions", {
            "prompt": "x", "max_tokens": 400, "ignore_eos": True}, timeout=120)))
        t.start()
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                h = httpx.get(srv.url + "/health")
                if h.status_code == 503:
                    break
                time.sleep(0.1)
            assert h.status_code == 503 and "engine stuck" in h.json()["reason"], h.text
            assert value(scrape(srv), "sightline_seconds_since_last_token") > 1
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(60)
        assert done and done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 400
        assert httpx.get(srv.url + "/health").status_code == 200
        assert srv.debug()["pids"]["scheduler"] == pid  # recovered by SIGCONT, no restart
    finally:
        srv.stop()
