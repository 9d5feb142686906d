"""SIGTERM with 20 streams open, on a 2-worker x 2-rank server and on one replica behind a real
HAProxy (deploy/haproxy/haproxy.cfg, this server its one live replica): every stream either
finishes within --shutdown-grace or ends with an explicit error event and [DONE]; the server
exits 0 soon after the grace, leaving no process behind."""

from __future__ import annotations

import contextlib
import signal
import time
import types

import psutil
import pytest

from loadtest.server import free_port
from tests.prom_util import HAProxy, require_tool
from tests.server_util import ServerProc, Stream, wait_until

GRACE = 1.0  # short: the native kernels stream tiny-random fast, and the long streams must still be cut
EXIT_MARGIN = 15.0  # past the grace: HTTP close, workers' exit, the engine's stop, on a busy 2-core machine
SHORT = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}
# --enforce-eager: decode layer by layer, so that the long streams on tiny-random outlast the grace
SETUPS = {"workers_and_ranks": ("--tokenizer-worker-num", "2", "--dp-size", "2", "--enforce-eager"),
          "behind_haproxy": ()}


@contextlib.contextmanager
def haproxy(tmp_path, srv: ServerProc):
    """A real HAProxy whose replica1 is `srv`; the other two slots point at ports nothing listens on."""
    require_tool("haproxy")
    lb = HAProxy(tmp_path, [f"127.0.0.1:{srv.port}", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    try:
        lb.wait_all("UP", ["replica1"])
        lb.wait_all("DOWN", ["replica2", "replica3"])
        yield types.SimpleNamespace(url=lb.url)
    finally:
        lb.stop()


@pytest.mark.parametrize("setup", SETUPS)
def test_sigterm_with_20_streams_ends_each_explicitly_and_exits_0(tmp_path, setup):
    srv = ServerProc(*SETUPS[setup], "--shutdown-grace", str(GRACE), tmpdir=tmp_path)
    procs = [psutil.Process(pid) for pid in srv.pids.values()]
    try:
        with haproxy(tmp_path, srv) if setup == "behind_haproxy" else contextlib.nullcontext(srv) as target:
            streams = [Stream(target, f"stream {i}", LONG if i % 2 else SHORT) for i in range(20)]
            wait_until(lambda: all(s.events or not s.is_alive() for s in streams), 60, "20 streams under way")
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            code = srv.proc.wait(GRACE + EXIT_MARGIN)
            took = time.monotonic() - t0
            for s in streams:
                s.join(10)
    finally:
        srv.stop()
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
    # the short ones finish; long ones still running at the grace's end are cut (on tiny-random most
    # long streams finish first, however short the grace: at least one must be cut)
    assert ended["finished"] >= 10 and ended["shut down"] >= 1, ended
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs), 10,
               "every worker and engine process to be gone")
    assert "Traceback" not in srv.log(), srv.log()[-3000:]
