"""Stopping the server: every in-flight request ends explicitly, no orphan, no socket file.  The stream
a stop must find running is held (tests.server_util.HOLD) when the signal lands."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import psutil
import pytest

from tests.server_util import HOLD, ServerProc, sse_events, wait_until


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stream_in_thread(url: str, body: dict, events: list) -> threading.Thread:
    def run():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events.extend(sse_events(r.iter_lines()))

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_stop_leaves_no_child_and_no_socket_and_ends_streams(tmp_path, how):
    srv = ServerProc("--shutdown-grace", "0", tmpdir=tmp_path)
    assert srv.runtime_dir.is_dir() and oct(srv.runtime_dir.stat().st_mode & 0o777) == "0o700"
    socks = sorted(p.name for p in srv.runtime_dir.iterdir() if p.name != "stacks")
    assert socks == ["detokenizer", "scheduler", "tm-detok", "tm-sched"]
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in srv.runtime_dir.iterdir() if p.name != "stacks")
    stacks = srv.runtime_dir / "stacks"  # each child's faulthandler file, for crash dumps
    assert oct(stacks.stat().st_mode & 0o777) == "0o700"
    assert sorted(int(p.stem) for p in stacks.iterdir()) == sorted(srv.pids[r] for r in ("scheduler", "detokenizer"))
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in stacks.iterdir())
    children = [psutil.Process(pid) for pid in srv.pids.values()]
    events: list = []
    t = _stream_in_thread(srv.url, {"prompt": "tell me", "max_tokens": 8, **HOLD}, events)
    srv.wait_held(1)
    if how == "sigterm":
        code = srv.stop(signal.SIGTERM)
    else:  # a terminal's Ctrl-C reaches the whole process group
        os.killpg(srv.proc.pid, signal.SIGINT)
        code = srv.stop(signal.SIGINT)
    t.join(10)
    assert not t.is_alive()
    assert code == 0, srv.log()
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "shutting down" in events[-2]["error"]["message"]
    assert all(_gone(c.pid) for c in children)
    assert not srv.runtime_dir.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("sightline-")]
    assert "Traceback" not in srv.log(), srv.log()


def test_graceful_shutdown_lets_in_flight_requests_finish(tmp_path):
    srv = ServerProc("--shutdown-grace", "30", tmpdir=tmp_path)
    children = [psutil.Process(pid) for pid in srv.pids.values()]
    events: list = []
    t = _stream_in_thread(
        srv.url, {"prompt": "tell me", "max_tokens": 16, **HOLD, "stream_options": {"include_usage": True}}, events
    )
    srv.wait_held(1)
    srv.proc.send_signal(signal.SIGTERM)
    # while draining (the held stream keeps it draining), new work is refused with 503: the listener is still up
    refused = wait_until(
        lambda: (
            (r := srv.post("/v1/completions", {"prompt": "late", "max_tokens": 2}, timeout=5)).status_code == 503 and r
        ),
        10,
        "a 503 while draining",
    )
    assert srv.held() == 1 and t.is_alive()  # the refusal did not end the stream in flight
    srv.release()
    t.join(60)
    code = srv.stop(timeout=60)
    assert code == 0, srv.log()
    *_, last, usage, done = events
    assert done == "[DONE]" and last["choices"][0]["finish_reason"] == "length", events[-3:]
    assert usage["usage"]["completion_tokens"] == 16, usage  # every token, the held one's last too
    assert refused is not None and refused.json()["error"]["type"] == "server_unavailable"
    assert all(_gone(c.pid) for c in children) and not srv.runtime_dir.exists()
