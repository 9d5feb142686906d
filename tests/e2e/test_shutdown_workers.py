"""SIGTERM with 20 streams open, on a 2-worker x 2-rank server and on one replica behind a real
HAProxy (deploy/haproxy/haproxy.cfg, this server its one live replica): every stream either
finishes within --shutdown-grace or ends with an explicit error event and [DONE]; the server
exits 0 soon after the grace, leaving no process behind.

All 20 streams are held (tests.server_util.HOLD) when the signal lands: the 10 short ones are
released right after it and finish within the grace, the 10 long ones stay held and are cut."""

from __future__ import annotations

import contextlib
import signal
import time
import types

import psutil
import pytest

from loadtest.server import free_port
from tests.prom_util import HAProxy, require_tool
from tests.server_util import HOLD, ServerProc, Stream, wait_until

GRACE = 2.0  # the released streams' last token must reach their clients within it, on a busy 2-core machine
EXIT_MARGIN = 15.0  # past the grace: HTTP close, workers' exit, the engine's stop, on a busy 2-core machine
SHORT = {"max_new_tokens": 8, "temperature": 0, **HOLD}  # released after the SIGTERM: finishes
LONG = {"max_new_tokens": 16, "temperature": 0, **HOLD}  # never released: cut at the grace's end
SETUPS = {"workers_and_ranks": ("--tokenizer-worker-num", "2", "--dp-size", "2"), "behind_haproxy": ()}


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


def _rid(s: Stream) -> str:
    return next(e["meta_info"]["id"] for e in s.events if isinstance(e, dict))


@pytest.mark.parametrize("setup", SETUPS)
def test_sigterm_with_20_streams_ends_each_explicitly_and_exits_0(tmp_path, setup):
    srv = ServerProc(*SETUPS[setup], "--shutdown-grace", str(GRACE), tmpdir=tmp_path)
    dp_size = 2 if "--dp-size" in SETUPS[setup] else 1
    procs = [psutil.Process(pid) for pid in srv.pids.values()]
    try:
        with haproxy(tmp_path, srv) if setup == "behind_haproxy" else contextlib.nullcontext(srv) as target:
            streams = [Stream(target, f"stream {i}", LONG if i % 2 else SHORT) for i in range(20)]
            srv.wait_held(20)
            wait_until(lambda: all(s.events for s in streams), 10, "every stream's first tokens at its client")
            short_rids = [_rid(s) for s in streams[::2]]
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            srv.release(*short_rids, dp_size=dp_size)  # within the grace: the short ones finish
            code = srv.proc.wait(GRACE + EXIT_MARGIN)
            took = time.monotonic() - t0
            for s in streams:
                s.join(10)
    finally:
        srv.stop()
    assert code == 0 and GRACE <= took < GRACE + EXIT_MARGIN, (code, took, srv.log()[-3000:])
    ended = {"finished": [], "shut down": []}
    for i, s in enumerate(streams):
        assert not s.is_alive() and s.status == 200 and s.events and s.events[-1] == "[DONE]", s.events[-3:]
        last = s.events[-2]
        if "error" in last:
            assert "shutting down" in last["error"]["message"], last
            assert len(s.tokens()) == LONG["max_new_tokens"] - 1, (i, s.tokens())  # cut while held
            ended["shut down"].append(i)
        else:
            assert last["meta_info"]["finish_reason"]["type"] == "length", last
            assert len(s.tokens()) == SHORT["max_new_tokens"], (i, s.tokens())
            ended["finished"].append(i)
    # the released short ones finish within the grace; the long ones, still held at its end, are cut
    assert ended == {"finished": list(range(0, 20, 2)), "shut down": list(range(1, 20, 2))}, ended
    wait_until(
        lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs),
        10,
        "every worker and engine process to be gone",
    )
    assert "Traceback" not in srv.log(), srv.log()[-3000:]
