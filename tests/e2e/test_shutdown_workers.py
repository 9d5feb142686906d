"""SIGTERM on a 2-worker x 2-rank server with 20 streams open: every stream either finishes within
--shutdown-grace or ends with an explicit error event and [DONE]; the server exits 0 soon after
the grace, leaving no process behind."""

from __future__ import annotations

import signal
import time

import psutil

from tests.server_util import ServerProc, Stream, wait_until

GRACE = 4.0
EXIT_MARGIN = 15.0  # past the grace: HTTP close, workers' exit, the engine's stop, on a busy 2-core machine


def test_sigterm_with_20_streams_on_workers_and_ranks(tmp_path):
    srv = ServerProc("--tokenizer-worker-num", "2", "--dp-size", "2", "--shutdown-grace", str(GRACE),
                     tmpdir=tmp_path)
    procs = [psutil.Process(pid) for pid in srv.pids.values()]
    short = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    long = {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}
    streams = [Stream(srv, f"stream {i}", long if i % 2 else short) for i in range(20)]
    try:
        wait_until(lambda: all(s.events for s in streams), 60, "20 streams under way")
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(GRACE + EXIT_MARGIN)
        took = time.monotonic() - t0
    finally:
        srv.stop()
    for s in streams:
        s.join(10)
    assert code == 0 and took < GRACE + EXIT_MARGIN, (code, took, srv.log()[-3000:])
    ended = {"finished": 0, "shut down": 0}
    for s in streams:
        assert not s.is_alive() and s.status == 200 and s.events and s.events[-1] == "[DONE]", s.events[-3:]
        last = s.events[-2]
        if "error" in last:
            assert "shutting down" in last["error"]["message"], last
            ended["shut down"] += 1
        else:
            assert last["meta_info"]["finish_reason"]["type"] == "length", last
            ended["finished"] += 1
    assert ended["finished"] >= 10 and ended["shut down"] >= 5, ended  # the short ones finish, the long are cut
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs), 10,
               "every worker and engine process to be gone")
    assert "Traceback" not in srv.log(), srv.log()[-3000:]
