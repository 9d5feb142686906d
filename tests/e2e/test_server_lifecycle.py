"""Stopping the server: every in-flight request ends explicitly, no orphan, no socket file."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import psutil
import pytest

from tests.server_util import ServerProc, sse_events


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stream_in_thread(url: str, body: dict, events: list, started: threading.Event) -> threading.Thread:
    def run():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started.set()
            events.extend(sse_events(lines))

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
    started = threading.Event()
    t = _stream_in_thread(srv.url, {"prompt": "tell me", "max_tokens": 1500, "ignore_eos": True}, events, started)
    assert started.wait(30)
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
    started = threading.Event()
    t = _stream_in_thread(srv.url, {"prompt": "tell me", "max_tokens": 120, "ignore_eos": True}, events, started)
    assert started.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    refused = None
    for _ in range(50):  # while draining, new work is refused with 503 (the listener is still up)
        try:
            r = srv.post("/v1/completions", {"prompt": "late", "max_tokens": 2}, timeout=5)
        except httpx.HTTPError:
            break
        if r.status_code == 503:
            refused = r
            break
    t.join(60)
    code = srv.stop(timeout=60)
    assert code == 0, srv.log()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 50
    assert refused is not None and refused.json()["error"]["type"] == "server_unavailable"
    assert all(_gone(c.pid) for c in children) and not srv.runtime_dir.exists()
