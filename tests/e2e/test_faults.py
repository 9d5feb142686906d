"""Fault injection under load: kill -9 / SIGSTOP the engine processes while streams run.

The streams a fault cuts are held (the hold seam: each has streamed all but its last token and
stays running), so every one of them is running when the fault lands.  Every stream must end with
an explicit error (SSE error event, then [DONE]) within 2 s of the kill, after exactly the
tokens it had, and the server must be healthy and serving again within the restart budget
(RESTART_BUDGET_S: spawning both children and loading tiny-random).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server_util import HOLD, ServerProc, Stream, samples, scrape, sse_events, value, wait_until

RESTART_BUDGET_S = 30.0
STREAMS = 16
MAX_TOKENS = 8  # a held stream has all but its last token when the fault lands


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc("--watchdog-timeout", "1.5", tmpdir=tmp_path_factory.mktemp("faults"))
    yield srv
    srv.stop()


class Streams:
    """N held streams in threads (each has sent all but its last token once started); records when each
    ended and how."""

    def __init__(self, srv: ServerProc, n: int) -> None:
        self.url = srv.url
        self.ended: dict[int, float] = {}
        self.events: dict[int, list] = {}
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()
        srv.wait_held(n)

    def _run(self, i: int) -> None:
        body = {
            "prompt": f"story {i}",
            "max_tokens": MAX_TOKENS,
            "stream": True,
            **HOLD,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        lines: list[str] = []
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(r.iter_lines())
        finally:
            self.ended[i] = time.monotonic()
            self.events[i] = sse_events(lines)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


def wait_healthy(srv: ServerProc, since: float, reasons: list[str] | None = None) -> float:
    """Seconds from `since` to /health 200; `reasons` gathers what each 503 said meanwhile."""

    def healthy() -> bool:
        try:
            r = httpx.get(srv.url + "/health", timeout=2)
        except httpx.HTTPError:
            return False
        if r.status_code != 200 and reasons is not None:
            reasons.append(r.json()["reason"])
        return r.status_code == 200

    try:
        wait_until(healthy, RESTART_BUDGET_S - (time.monotonic() - since), "/health 200", interval=0.1)
    except AssertionError:
        raise AssertionError(f"not healthy within {RESTART_BUDGET_S} s:\n{srv.log()[-3000:]}") from None
    return time.monotonic() - since


def inject(srv: ServerProc, role: str, sig: int) -> tuple[Streams, float]:
    pid = srv.debug()["pids"][role]
    streams = Streams(srv, STREAMS)
    t0 = time.monotonic()
    os.kill(pid, sig)
    streams.join(30)
    return streams, t0


def check_startup_phases(text: str) -> None:
    """Every process's latest start, phase by phase, each a real duration; the phases of a start sum to about
    the process's whole start (the imports of a process that imports torch take a while)."""
    phases = {
        "main": ("imports", "args", "spawn"),
        "detokenizer": ("imports", "tokenizer_load"),
        "scheduler": ("imports", "model_resolve", "native_kernels", "weight_load", "kv_pool"),
    }
    got = {
        (x.labels["role"], x.labels["phase"]): x.value
        for x in samples(text)
        if x.name == "sightline_startup_phase_seconds"
    }
    for role, names in phases.items():
        for phase in names:
            assert got.get((role, phase), -1) >= 0, (role, phase, got)
    assert value(text, "sightline_startup_phase_seconds", role="scheduler", phase="imports") > 0.1
    assert 0 < value(text, "sightline_startup_phase_seconds", role="main", phase="spawn") < RESTART_BUDGET_S


def check_explicit_errors(streams: Streams, t0: float, within: float) -> None:
    assert len(streams.ended) == STREAMS, "a stream hung"
    for i, events in streams.events.items():
        assert events[-1] == "[DONE]", events[-3:]
        usage = [e["usage"]["completion_tokens"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert usage[-1] == MAX_TOKENS - 1, usage  # every token it had streamed, then the error
        err = events[-2]["error"]
        assert err["type"] == "server_unavailable" and "engine failed" in err["message"]
        assert streams.ended[i] - t0 < within, f"stream {i} ended {streams.ended[i] - t0:.2f} s after the fault"


@pytest.mark.parametrize("role", ["scheduler", "detokenizer"])
def test_kill_9_a_child_under_load(server, role):
    before = scrape(server)
    streams, t0 = inject(server, role, signal.SIGKILL)
    check_explicit_errors(streams, t0, within=2.0)
    reasons: list[str] = []
    restart_s = wait_healthy(server, t0, reasons)
    r = server.post("/v1/completions", {"prompt": "after the crash", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    text = scrape(server)
    # the restart, timed: one recovery, no longer than the client saw; /health said which phase it was in
    assert (
        value(text, "sightline_engine_recovery_seconds_count")
        - value(before, "sightline_engine_recovery_seconds_count")
        == 1
    )
    recovery = value(text, "sightline_engine_recovery_seconds_sum") - value(
        before, "sightline_engine_recovery_seconds_sum"
    )
    assert 0.5 <= recovery <= restart_s, (recovery, restart_s)  # at least the first restart's backoff
    assert any(
        re.search(
            r"starting: .*\((imports|model_resolve|native_kernels|weight_load|kv_pool|"
            r"tokenizer_load)\)",
            why,
        )
        for why in reasons
    ), reasons[-5:]
    check_startup_phases(text)
    for name, labels, n in (
        ("sightline_engine_failures_total", {"role": role, "cause": "exited"}, 1),
        ("sightline_requests_total", {"finish_reason": "abort", "status": "503"}, STREAMS),
    ):
        assert value(text, name, **labels) - value(before, name, **labels) == n, (name, labels)
    assert server.held() == 0  # the new engine holds nothing
    assert f'"role": "{role}"' in server.log() and "engine failure" in server.log()
    print(f"{role} killed: streams failed within 2 s, healthy again after {restart_s:.1f} s")


def test_sigstop_scheduler_is_detected_as_a_stall_and_recovered(server):
    pid = server.debug()["pids"]["scheduler"]
    aborted = value(scrape(server), "sightline_requests_total", finish_reason="abort", status="503")
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
    text = scrape(server)
    assert value(text, "sightline_engine_failures_total", role="scheduler", cause="stalled") == 1
    assert value(text, "sightline_requests_total", finish_reason="abort", status="503") - aborted == STREAMS
    assert server.post("/v1/completions", {"prompt": "after the stall", "max_tokens": 3}).status_code == 200
    print(f"scheduler stopped: detected and healthy again after {restart_s:.1f} s")


def test_exit_policy_stops_the_server(tmp_path):
    srv = ServerProc("--on-engine-failure", "exit", tmpdir=tmp_path)
    os.kill(srv.debug()["pids"]["scheduler"], signal.SIGKILL)
    assert srv.proc.wait(30) == 1
    assert not srv.runtime_dir.exists()


def test_health_fails_while_the_engine_is_stuck_and_sigcont_recovers(tmp_path):
    """A request whose tokens flow (the step floor: 40 tokens last at least 4 s) is stopped mid-run by
    SIGSTOP: /health says stuck after --stall-timeout; SIGCONT lets it finish where it was, no restart."""
    n = 40
    srv = ServerProc("--stall-timeout", "1", "--watchdog-timeout", "120", tmpdir=tmp_path, step_floor_ms=100)
    try:
        pid = srv.debug()["pids"]["scheduler"]
        s = Stream(srv, "x", {"max_new_tokens": n, "ignore_eos": True})
        wait_until(lambda: s.tokens(), 30, "the first token")
        os.kill(pid, signal.SIGSTOP)
        try:

            def stuck():
                h = httpx.get(srv.url + "/health")
                return h if h.status_code == 503 else None

            h = wait_until(stuck, 10, "/health 503", interval=0.1)
            assert "engine stuck" in h.json()["reason"], h.text
            assert value(scrape(srv), "sightline_seconds_since_last_token") > 1
        finally:
            t_cont = time.monotonic()
            os.kill(pid, signal.SIGCONT)
        s.join(60)
        assert s.status == 200 and len(s.tokens()) == n and s.events[-1] == "[DONE]"
        before_cont = [e for e, t in zip(s.events, s.times) if t < t_cont and isinstance(e, dict)]
        assert len(before_cont[-1]["output_ids"]) < n  # it was running when stopped: the rest came after SIGCONT
        assert httpx.get(srv.url + "/health").status_code == 200
        assert srv.debug()["pids"]["scheduler"] == pid  # recovered by SIGCONT, no restart
    finally:
        srv.stop()
