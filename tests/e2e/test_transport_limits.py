"""Clients that hold connections, stop reading or leave mid-upload cannot exhaust the
server's file descriptors, hold a request past its deadline, break shutdown, or count
as server errors.  The streams nobody reads are held (the hold seam): they never end on
their own, so only the server's stall cap, deadline or shutdown can end them."""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import socket
import time

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest

from tests.server_util import HOLD, ServerProc, scrape, value, wait_until

STALL = 3.0  # --send-stall-timeout of the shared server


@contextlib.contextmanager
def fd_limit(n: int):
    """Processes started inside inherit an open-files limit of n; this one gets its own back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class StalledH2:
    """An h2c (prior knowledge) client whose stream flow-control window is 0: it never takes data."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=0.2)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        self.sock.sendall(self.conn.data_to_send())
        self.events: list = []

    def post(self, body: dict, headers: tuple = ()) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [
                (b":method", b"POST"),
                (b":path", b"/v1/completions"),
                (b":scheme", b"http"),
                (b":authority", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                *headers,
            ],
        )
        self.conn.send_data(sid, json.dumps(body).encode(), end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        return sid

    def wait_for(self, kind: type, timeout: float):
        """Read frames until an event of `kind` arrives (returned) or `timeout` passes (None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((e for e in self.events if isinstance(e, kind)), None)
            if found is not None:
                return found
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not data:
                return None
            self.events.extend(self.conn.receive_data(data))
            self.sock.sendall(self.conn.data_to_send())
        return None

    def close(self) -> None:
        self.sock.close()


def _until(check, timeout: float):
    """`check()`'s first truthy result within `timeout`, else None (the caller says what failed)."""
    try:
        return wait_until(check, timeout, "the check", interval=0.2)
    except AssertionError:
        return None


HELD = {"prompt": "never read", "max_tokens": 8, "stream": True, **HOLD}  # runs until cut: never ends on its own


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = ServerProc("--send-stall-timeout", str(STALL), tmpdir=tmp_path_factory.mktemp("transport"))
    yield server
    server.stop()


def test_idle_connections_time_out_and_cannot_exhaust_fds(tmp_path):
    with fd_limit(200):
        server = ServerProc("--keep-alive-timeout", "2", "--body-read-timeout", "3", tmpdir=tmp_path)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n"
    )
    kinds = [b"POST /v1/completions HTTP/1.1\r\nHost: 127.0", head, head + b'{"prompt": "half a bo']
    socks = []
    try:
        for i in range(190):  # more than the 200-fd server can hold
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(kinds[i % 3])
            socks.append(s)
        start = time.monotonic()

        def healthy():
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(server.url + "/health", timeout=2).status_code == 200

        assert _until(healthy, 15), server.log()[-3000:]  # refused (503) while full, served once they time out
        assert time.monotonic() - start < 15
        answers = []
        for s in socks:  # the server closed every one of them: a 408 for a missing body, else just closed
            s.settimeout(max(0.1, start + 15 - time.monotonic()))
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(65536):
                    data += chunk
            answers.append(data)
        timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
        assert len(timed_out) >= 40, [a[:40] for a in answers]
        assert json.loads(timed_out[0].split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
        assert all(a == b"" or a.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")) for a in answers)
        metrics = scrape(server)
        assert value(metrics, "sightline_http_connections_refused_total") >= 1
        log = server.log()
        assert log.count("out of system resource") <= 2 and len(log) < 200_000, log[-2000:]
    finally:
        for s in socks:
            s.close()
        assert server.stop() == 0


def test_accept_errors_log_one_line_per_interval_and_the_server_recovers(tmp_path):
    with fd_limit(200):  # a cap above what the fds allow: accept() does fail with EMFILE
        server = ServerProc(
            "--max-connections",
            "1000",
            "--accept-error-log-interval",
            "60",
            "--keep-alive-timeout",
            "2",
            "--body-read-timeout",
            "3",
            tmpdir=tmp_path,
        )
    socks = []
    try:
        for _ in range(190):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n"
            )
            socks.append(s)
        time.sleep(2)  # clock: asyncio retries accept() every second (up to 100 times each): two rounds of them

        def healthy():
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(server.url + "/health", timeout=2).status_code == 200

        assert _until(healthy, 20), server.log()[-3000:]
    finally:
        for s in socks:
            s.close()
        assert server.stop() == 0
    log = server.log()  # hundreds of lines a second, each with a traceback, without the rate limit
    accept_errors = [line for line in log.splitlines() if "out of system resource" in line]
    assert 1 <= len(accept_errors) <= 2 and "Too many open files" in accept_errors[0], accept_errors
    assert log.count("_start_serving") <= 2 and "Traceback" not in log, log[-3000:]


def test_client_gone_mid_upload_is_a_client_abort_not_a_500(srv):
    before, log_start = scrape(srv), len(srv.log())
    body = json.dumps({"prompt": "x" * 2000, "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body[: len(body) // 2])
        )

    def delta(name, **labels):
        return value(scrape(srv), name, **labels) - value(before, name, **labels)

    assert _until(lambda: delta("sightline_requests_total", status="499") == 1, 10)
    assert delta("sightline_requests_total", finish_reason="abort", status="499") == 1
    assert delta("sightline_request_aborts_total", reason="client_disconnect") == 1
    assert delta("sightline_requests_total", status="500") == 0
    assert "Traceback" not in srv.log()[log_start:]


def test_http2_clients_that_read_get_whole_responses(srv):
    """The per-chunk flush wait that detects stalls costs a reading client nothing."""
    with httpx.Client(http1=False, http2=True, base_url=srv.url, timeout=60) as client:  # h2c prior knowledge
        body = {"prompt": "read me", "max_tokens": 40, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.http_version == "HTTP/2" and r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) > 40
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def test_stalled_http2_stream_is_reset_and_its_request_aborted(srv):
    before = scrape(srv)
    client = StalledH2(srv.port)
    try:
        sid = client.post(HELD)
        assert client.wait_for(h2.events.ResponseReceived, 30) is not None
        start = time.monotonic()
        srv.wait_held(1)  # running, all but its last token produced, none of them taken
        reset = client.wait_for(h2.events.StreamReset, STALL + 10)
        assert reset is not None and reset.stream_id == sid, client.events
        assert time.monotonic() - start < STALL + 10
    finally:
        client.close()
    assert _until(lambda: srv.debug()["in_flight"] == 0, 10)
    assert srv.held() == 0 and srv.debug()["scheduler"]["num_running"] == 0  # the abort reached the engine
    after = scrape(srv)
    assert (
        value(after, "sightline_request_aborts_total", reason="client_disconnect")
        - value(before, "sightline_request_aborts_total", reason="client_disconnect")
        == 1
    )
    assert value(after, "sightline_requests_total", finish_reason="length") == value(
        before, "sightline_requests_total", finish_reason="length"
    )  # cut off, not run to the end
    assert (
        value(after, "sightline_http_stream_stalls_total", cause="stalled")
        - value(before, "sightline_http_stream_stalls_total", cause="stalled")
        == 1
    )


def test_stalled_http2_stream_ends_at_its_request_deadline(srv):
    before = scrape(srv)
    client = StalledH2(srv.port)
    try:
        start = time.monotonic()
        sid = client.post(HELD, headers=((b"x-request-timeout", b"1"),))
        reset = client.wait_for(h2.events.StreamReset, 1 + 1 + STALL)  # deadline + grace, before the stall cap
        assert reset is not None and reset.stream_id == sid, client.events
        assert time.monotonic() - start < 1 + STALL
    finally:
        client.close()
    assert _until(lambda: srv.debug()["in_flight"] == 0, 10)
    assert srv.held() == 0 and srv.debug()["scheduler"]["num_running"] == 0
    after = scrape(srv)
    assert (
        value(after, "sightline_request_aborts_total", reason="timeout")
        - value(before, "sightline_request_aborts_total", reason="timeout")
        == 1
    )
    assert value(after, "sightline_requests_total", finish_reason="length") == value(
        before, "sightline_requests_total", finish_reason="length"
    )  # cut off at its deadline, not run to the end
    assert (
        value(after, "sightline_http_stream_stalls_total", cause="deadline")
        - value(before, "sightline_http_stream_stalls_total", cause="deadline")
        == 1
    )


def test_sigterm_with_a_stalled_http2_stream_exits_0(tmp_path):
    server = ServerProc("--shutdown-grace", "1", tmpdir=tmp_path)  # the default 30 s stall cap never fires here
    client = StalledH2(server.port)
    try:
        client.post(HELD)
        assert client.wait_for(h2.events.ResponseReceived, 30) is not None
        server.wait_held(1)  # running when SIGTERM comes: only the grace ends it
        start = time.monotonic()
        code = server.stop(signal.SIGTERM, timeout=30)
        assert code == 0, server.log()[-5000:]
        assert time.monotonic() - start < 1 + 12  # grace + closing connections + stopping the children
    finally:
        client.close()
    assert "Traceback" not in server.log(), server.log()[-5000:]
