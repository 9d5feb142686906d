"""Engine restarts that fail, and who may say Ready.

A child that dies while the engine is being restarted must not take the server down:
the restart is retried with backoff, within `--max-engine-restarts` per window; once
that budget is spent the server stays up answering 503 with the reason.  A `Ready`
sets the context length every request is validated against, so only the child just
spawned for that role may send it, once.  One server (default budget) serves the
Ready and restart tests, in file order; the budget test starts its own.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest

from protocol.io_struct import Ready
from tests.server_util import ServerProc, push, scrape, value, wait_until

RECOVER_S = 120.0  # a restart of tiny-random takes 8-15 s on an idle 2-core machine, far more on a busy one


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(tmpdir=tmp_path_factory.mktemp("restart"))
    yield srv
    srv.stop()


def spoof_ready(srv: ServerProc, **fields) -> None:
    """Push a Ready to the TokenizerManager's Scheduler socket, as any local process could."""
    push(srv, "tm-sched", Ready(**fields))


def starting_scheduler(srv: ServerProc, not_pid: int) -> int:
    """The pid of a newly spawned Scheduler (a live child of the server) that has not reported Ready."""

    def probe():
        state = srv.debug()
        pid = state["pids"].get("scheduler")
        if pid is None or pid == not_pid or "scheduler" in state["ready"]:
            return None
        kids = {p.pid for p in psutil.Process(srv.proc.pid).children()}
        return pid if pid in kids else None

    return wait_until(probe, 30, "a new Scheduler process")


def rejected(srv: ServerProc) -> tuple[int, dict]:
    state = srv.debug()
    return state["undecodable"]["tokenizer_manager"], state["ready_rejected"]


def completion_ok(srv: ServerProc) -> None:
    r = srv.post("/v1/completions", {"prompt": "hello there, how are you", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_a_spoofed_ready_is_counted_and_never_applied(server):
    real_ctx = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert real_ctx > 2
    before, _ = rejected(server)
    # even with the real Scheduler's pid: that child already reported Ready once
    spoof_ready(server, role="scheduler", pid=server.pids["scheduler"], context_len=2, vocab_size=3)
    spoof_ready(server, role="scheduler", pid=12345, context_len=2, vocab_size=3)
    wait_until(lambda: rejected(server)[0] == before + 2, 10, "the spoofed Ready to be counted")
    assert rejected(server)[1] == {"not_starting": 2}
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == real_ctx
    completion_ok(server)
    assert value(scrape(server), "sightline_undecodable_messages_total", component="tokenizer_manager") == before + 2
    assert "ignored a Ready(role='scheduler', pid=" in server.log()


def test_a_child_dying_during_the_restart_is_retried(server):
    old = server.debug()["pids"]["scheduler"]
    os.kill(old, signal.SIGKILL)
    first = starting_scheduler(server, old)
    os.kill(first, signal.SIGKILL)  # the replacement dies before it is ready
    h = wait_until(
        lambda: (
            (r := httpx.get(server.url + "/health")).status_code == 503
            and "restart attempt 2" in r.json()["reason"]
            and r
        ),
        30,
        "/health to name attempt 2",
    )
    assert "before it was ready" in h.json()["reason"], h.text
    second = starting_scheduler(server, first)
    # while the second replacement starts, a Ready under the wrong pid must not count as its
    spoof_ready(server, role="scheduler", pid=second + 100000, context_len=2, vocab_size=3)
    server.wait_healthy(RECOVER_S)
    assert server.proc.poll() is None
    assert server.debug()["pids"]["scheduler"] == second
    assert rejected(server)[1].get("wrong_pid") == 1
    completion_ok(server)
    text = scrape(server)
    assert value(text, "sightline_engine_failures_total", role="scheduler", cause="exited") == 2
    assert value(text, "sightline_engine_restarts_total") == 1
    assert value(text, "sightline_engine_restart_budget_exhausted") == 0
    assert "scheduler exited with code -9 before it was ready" in server.log()


def test_sigterm_during_a_restart_exits_cleanly_and_promptly(server):
    old = server.debug()["pids"]["scheduler"]
    os.kill(old, signal.SIGKILL)
    starting = starting_scheduler(server, old)
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    t0 = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=20) == 0
    assert time.monotonic() - t0 < 8, f"shutdown took {time.monotonic() - t0:.1f} s"
    assert not psutil.pid_exists(starting) or psutil.Process(starting).status() == psutil.STATUS_ZOMBIE
    wait_until(
        lambda: not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids),
        5,
        "every child to be gone",
    )
    assert not server.runtime_dir.exists()


def test_a_spent_restart_budget_leaves_the_server_up_answering_503(tmp_path):
    grace = 5.0
    srv = ServerProc("--max-engine-restarts", "1", "--liveness-down-grace", str(grace), tmpdir=tmp_path)
    try:
        assert value(scrape(srv), "sightline_engine_restart_budget_exhausted") == 0
        old = srv.pids["scheduler"]
        os.kill(old, signal.SIGKILL)
        os.kill(starting_scheduler(srv, old), signal.SIGKILL)  # the one restart allowed fails too
        h = wait_until(
            lambda: (
                (r := httpx.get(srv.url + "/health")).status_code == 503
                and "budget is spent" in r.json()["reason"]
                and r
            ),
            30,
            "/health to report the spent budget",
        )
        assert "--max-engine-restarts 1" in h.json()["reason"], h.text
        spent = time.monotonic()
        assert httpx.get(srv.url + "/livez").status_code == 200  # alive through the grace
        # clock: past the backoff a restart attempt would wait (0.5 s doubling per attempt): none comes any more
        time.sleep(1.5)
        assert srv.proc.poll() is None and srv.debug()["pids"] == {}
        r = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 503 and err["type"] == "server_unavailable" and "budget is spent" in err["message"]
        text = scrape(srv)
        assert value(text, "sightline_engine_restart_budget_exhausted") == 1
        assert value(text, "sightline_engine_failures_total", role="scheduler", cause="exited") == 2
        assert value(text, "sightline_engine_restarts_total") == 0
        lines = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
        assert any(
            x["level"] == "error" and x["msg"].startswith("engine down: the restart budget is spent") for x in lines
        )
        live = wait_until(
            lambda: (r := httpx.get(srv.url + "/livez")).status_code == 503 and r,
            30,
            "/livez to fail once the grace is over",
        )
        assert time.monotonic() - spent >= grace - 1.0  # the budget was spent at most ~1 s before /health said so
        assert live.json() == {"status": "dead", "reason": h.json()["reason"]}
        t0 = time.monotonic()
        assert srv.stop(signal.SIGTERM, timeout=20) == 0 and time.monotonic() - t0 < 8
    finally:
        srv.stop()


def test_a_spent_budget_fails_livez_on_every_tokenizer_worker(tmp_path):
    """With workers, /livez is answered by whichever worker takes the connection: each learns from
    the hub's status when the budget was spent."""
    srv = ServerProc(
        "--tokenizer-worker-num", "2", "--max-engine-restarts", "0", "--liveness-down-grace", "1", tmpdir=tmp_path
    )
    try:
        assert httpx.get(srv.url + "/livez").status_code == 200
        os.kill(srv.pids["scheduler"], signal.SIGKILL)

        def every_worker_dead():  # new connections each: the kernel spreads them over the workers
            answers = [httpx.get(srv.url + "/livez", headers={"connection": "close"}) for _ in range(8)]
            return all(r.status_code == 503 and "budget is spent" in r.json()["reason"] for r in answers)

        wait_until(every_worker_dead, 30, "/livez to fail on every worker")
        assert srv.stop(signal.SIGTERM, timeout=30) == 0
    finally:
        srv.stop()
