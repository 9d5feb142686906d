"""The HTTP transport: Hypercorn's HTTP/1.1 and HTTP/2 code on our own accept loop, with limits.

Hypercorn caps neither connections nor how long a response may wait on a client that
stops reading, and a stream still blocked when its shutdown deadline passes makes its
`serve` raise.  Here:

* At most `--max-connections` connections are open (default: the open-files limit less
  a reserve for the server's own files).  One more is answered 503 and closed at once,
  so idle clients cannot use up the file descriptors and leave accept() failing.
* A connection idle between requests, or still sending its request headers, is closed
  after `--keep-alive-timeout` (Hypercorn's idle timer covers both); a body not in
  after `--body-read-timeout` gets 408 (`generation.read_body`).  Hypercorn's own
  `read_timeout` stays off: it limits every read on the connection, so it would also
  cut off a client silently waiting for a long generation.
* Every response send is bounded.  A send that makes no progress for
  `--send-stall-timeout` (an HTTP/1.1 client not reading; an HTTP/2 stream whose
  flow-control window stays shut), or that outlives the deadline an SSE response set
  (`Stream.deadline`), ends the stream: RST_STREAM on HTTP/2 (the connection lives on),
  a closed connection on HTTP/1.1.  The app then sees `http.disconnect`, which aborts
  its request as a client disconnect.
* A connection leaves the count (`sightline_http_connections_open`, `--max-connections`)
  as soon as its socket closes.  Hypercorn runs a connection's idle timer inside the
  connection's task group and stops it only after the group has exited, so a client
  that closes an idle keep-alive connection would keep it counted until the timer fires
  (`--keep-alive-timeout`); and a request finishing after the close re-arms the timer.
  `_Connection` stops the timer once reading has ended and ignores re-arming after that.
* Shutdown stops accepting, gives connections a few seconds, then closes the rest;
  nothing a client does makes it raise.
* accept() errors (EMFILE...) log one line per `--accept-error-log-interval` seconds,
  counting the ones left out.

Written against hypercorn==0.18.0 (pinned): `_Connection` reaches into its TCPServer and
H2Protocol to bound writes and to reset one HTTP/2 stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource
import secrets
import time
import uuid
from typing import Any, Awaitable, Callable

import h2.errors
import h2.exceptions
import priority
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.utils import repr_socket_addr, wrap_app

from serving.args import ServerArgs

log = logging.getLogger("sightline.http")
refusal_log = logging.getLogger("sightline.http.refused")

EXTENSION = "sightline.transport"  # scope["extensions"][EXTENSION] is the request's `Stream`
FD_RESERVE = 64  # at least this many descriptors stay for the server itself (ZMQ, logs, model files)
DEADLINE_GRACE = 1.0  # past its request's deadline a send may still deliver the timeout error for this long
SHUTDOWN_CLOSE = 3.0  # once shutdown starts (after the request drain), seconds connections get to finish
LINGER_S = 2.0  # a connection the server closes: how long it waits, half-closed, for the client to close too
# asyncio's messages when accept() fails for want of fds: one per queued connection (up to the
# backlog) each second, and as many retry timers that fail once the listener is closed
ACCEPT_ERRORS = ("socket.accept() out of system resource", "Exception in callback BaseSelectorEventLoop._start_serving")
REFUSAL = (
    b'{"error": {"message": "too many open connections; retry later", "type": "server_unavailable", '
    b'"param": null, "code": "too_many_connections"}}'
)
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def fresh_traceparent(incoming: str = "") -> str:
    """A valid W3C traceparent for a response no recorded span stands behind: the client's
    trace id when it sent a valid traceparent (its trace still finds the response), else a
    new one; a new span id; flags 00 (nothing of it was sampled or recorded here)."""
    incoming = incoming.strip().lower()
    m = _TRACEPARENT.fullmatch(incoming[:55]) if not incoming.startswith("ff") else None
    trace_id = m.group(1) if m and m.group(1).strip("0") else secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-00"


def id_headers(incoming_traceparent: str = "") -> list[tuple[bytes, bytes]]:
    """`x-request-id` and `traceparent` for a response that reached no generation: a fresh id
    (the format of a rid) and `fresh_traceparent`."""
    return [
        (b"x-request-id", uuid.uuid4().hex.encode()),
        (b"traceparent", fresh_traceparent(incoming_traceparent).encode()),
    ]


def refusal_response() -> bytes:
    """The 503 for a connection over the limit, written before any request is read."""
    ids = b"".join(b"%s: %s\r\n" % pair for pair in id_headers())
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n%s"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (ids, len(REFUSAL), REFUSAL)
    )


def default_max_connections(soft_limit: int | None = None) -> int:
    """Connections that fit in the open-files limit with max(64, 1/8 of it) kept back."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit > 1 << 20:
        soft_limit = 1 << 20
    return max(8, soft_limit - max(FD_RESERVE, soft_limit // 8))


class RateLimitFilter(logging.Filter):
    """Lets one matching record through per `interval` seconds, as one line that counts the
    ones dropped since; records starting with none of `prefixes` pass untouched."""

    def __init__(self, interval: float, prefixes: tuple[str, ...] = ("",)) -> None:
        super().__init__()
        self.interval = interval
        self.prefixes = prefixes
        self.dropped = 0
        self._last = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith(self.prefixes):
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self.dropped += 1
            return False
        self._last = now
        line = text.splitlines()[0] if text else text
        if record.exc_info and record.exc_info[1] is not None:
            line += f": {record.exc_info[1]}"
        if self.dropped:
            line += f" ({self.dropped} more like this not logged)"
        record.msg, record.args, record.exc_info, record.exc_text = line, (), None, None
        self.dropped = 0
        return True


class Stream:
    """One request's response path: every send bounded; `end` cuts the stream off."""

    def __init__(self, conn: "_Connection", send: Callable[[Any], Awaitable[None]], stream_id: int | None) -> None:
        self.conn = conn
        self._send = send
        self.stream_id = stream_id
        self.deadline: float | None = None  # loop time; an SSE response sets it from the request's timeout
        self.ended: str | None = None  # why the stream was cut off: stalled | deadline

    def _budget(self) -> tuple[float, str]:
        stall = self.conn.stall
        if self.deadline is not None:
            left = max(0.0, self.deadline - asyncio.get_running_loop().time()) + DEADLINE_GRACE
            if left < stall:
                return left, "deadline"
        return stall, "stalled"

    async def send(self, message: dict) -> None:
        if self.ended:
            return  # cut off: the app learns it from http.disconnect
        budget, cause = self._budget()
        try:
            async with asyncio.timeout(budget):
                await self._send(message)
                if message["type"] == "http.response.body":
                    await self.conn.flushed(self.stream_id)
        except TimeoutError:
            await self.end(cause)

    async def end(self, cause: str) -> None:
        if self.ended:
            return
        self.ended = cause
        self.conn.server.count_stall(cause)
        log.info(
            "response stream cut off (%s): the client took no data for %s",
            cause,
            "the request's deadline" if cause == "deadline" else f"{self.conn.stall:g} s",
        )
        await self.conn.end_stream(self.stream_id)


class _StreamApp:
    """Hypercorn's app callable for one connection: gives each request a bounded `Stream`."""

    def __init__(self, app, conn: "_Connection") -> None:
        self.app = app
        self.conn = conn

    async def __call__(self, scope, receive, send, sync_spawn, call_soon) -> None:
        stream = Stream(self.conn, send, getattr(getattr(send, "__self__", None), "stream_id", None))
        scope.setdefault("extensions", {})[EXTENSION] = stream
        await self.app(scope, receive, stream.send, sync_spawn, call_soon)


class _Connection(TCPServer):
    """Hypercorn's TCPServer with bounded writes and a way to end one stream."""

    def __init__(self, server: "HTTPServer", app, *args: Any) -> None:
        super().__init__(_StreamApp(app, self), *args)
        self.server = server
        self.stall = server.args.send_stall_timeout
        self.read_closed = False  # the peer closed (or the read failed): no idle timer may run from now on
        self._read_over = asyncio.Event()
        self._reader: asyncio.Task | None = None

    async def _read_data(self) -> None:
        """Hypercorn's read loop, then the idle timer stopped: the task group `run` waits on
        would otherwise keep the closed connection (and its count) until the timer fires."""
        self._reader = asyncio.current_task()
        try:
            await super()._read_data()
        finally:
            self.read_closed = True
            self._read_over.set()
            await self.idle_task.stop()

    async def _close(self) -> None:
        """A close the server decides (a request body the route never read, an idle timeout): half-close,
        then close once the client has closed too, or after LINGER_S.  Closing at once with the client's
        bytes still arriving (a body sent after its response was written) makes the kernel answer RST,
        and a client still reading the response loses its tail (`Connection reset by peer`)."""
        if not self.read_closed and asyncio.current_task() is not self._reader:
            with contextlib.suppress(NotImplementedError, OSError, RuntimeError):
                self.writer.write_eof()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LINGER_S):
                    await self._read_over.wait()  # the read loop drains what arrives until the client's EOF
        await super()._close()

    async def protocol_send(self, event) -> None:
        if isinstance(event, Updated) and self.read_closed:
            return  # a stream that ends after the close would re-arm the idle timer
        if isinstance(event, RawData):
            async with self.send_lock:
                try:
                    self.writer.write(event.data)
                    async with asyncio.timeout(self.stall):  # no task per write, unlike wait_for
                        await self.writer.drain()
                except TimeoutError:  # the client stopped reading: nothing more can reach it
                    self.abort()
                except (ConnectionError, RuntimeError):
                    await self.protocol.handle(Closed())
            return
        try:
            await super().protocol_send(event)
        except RuntimeError:  # shutdown: the connection's task group no longer takes its idle timer
            pass

    async def flushed(self, stream_id: int | None) -> None:
        """Wait until an HTTP/2 stream's buffered body went out (its flow-control window allowed it)."""
        proto = getattr(self.protocol, "protocol", None)
        buffer = proto.stream_buffers.get(stream_id) if isinstance(proto, H2Protocol) else None
        if buffer is not None and buffer.buffer:  # empty: nothing to wait for (and no pop would signal it)
            await buffer.drain()

    async def end_stream(self, stream_id: int | None) -> None:
        """HTTP/2: reset just this stream (CANCEL); HTTP/1.1 (or if that fails): close the connection."""
        proto = getattr(self.protocol, "protocol", None)
        if isinstance(proto, H2Protocol) and stream_id is not None and not proto.closed:
            try:
                buffer = proto.stream_buffers.pop(stream_id, None)
                if buffer is not None:
                    await buffer.close()
                with contextlib.suppress(priority.MissingStreamError):
                    proto.priority.remove_stream(stream_id)
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    proto.connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                await proto._close_stream(stream_id)  # the app gets http.disconnect
                await self.protocol_send(Updated(idle=proto.idle))  # restart the idle timer if it was the last
                await proto._flush()
                return
            except Exception:
                log.debug("could not reset HTTP/2 stream %s; closing its connection", stream_id, exc_info=True)
        self.abort()

    def abort(self) -> None:
        """Close at once, dropping unsent data; the read loop then ends the connection's streams."""
        with contextlib.suppress(Exception):
            self.writer.transport.abort()


class HTTPServer:
    """Accepts connections up to the limit and serves each with a `_Connection`."""

    def __init__(self, app, args: ServerArgs, metrics=None) -> None:
        self.args = args
        self.metrics = metrics
        self.config = Config()
        self.config.bind = [f"{args.host}:{args.port}"]
        self.config.accesslog = None
        self.config.errorlog = logging.getLogger("hypercorn.error")  # our handlers and format, once
        self.config.keep_alive_timeout = args.keep_alive_timeout
        # several tokenizer workers share the port: Hypercorn sets SO_REUSEPORT when it has several workers,
        # and the kernel spreads new connections over the listening processes
        self.config.workers = args.tokenizer_worker_num
        self.app = wrap_app(app, self.config.wsgi_max_body_size, "asgi")
        self.context = WorkerContext(None)
        self.limit = args.max_connections or default_max_connections()
        self.connections: dict[asyncio.Task, _Connection] = {}
        if metrics is not None:
            metrics.connections_open.set_function(lambda: len(self.connections))

    def count_stall(self, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.stream_stalls.labels(cause).inc()

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        if self.metrics is not None:
            self.metrics.connections_refused.inc()
        refusal_log.warning("refusing a connection: %d open (--max-connections %d)", len(self.connections), self.limit)
        with contextlib.suppress(Exception):
            writer.write(refusal_response())
            writer.close()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.connections) >= self.limit or self.context.terminated.is_set():
            self._refuse(writer)
            return
        task = asyncio.current_task()
        conn = _Connection(self, self.app, asyncio.get_running_loop(), self.config, self.context, {}, reader, writer)
        self.connections[task] = conn
        try:
            await conn.run()
        except asyncio.CancelledError:  # shutdown closing what is left
            conn.abort()
        except Exception as exc:  # one connection's failure is never the server's
            log.warning("HTTP connection failed: %s: %s", type(exc).__name__, exc)
            log.debug("HTTP connection failure", exc_info=True)
            conn.abort()
        finally:
            self.connections.pop(task, None)

    async def serve(self, shutdown_trigger: Callable[[], Awaitable[None]]) -> None:
        interval = self.args.accept_error_log_interval
        # for the process's life: asyncio's retry timers may still fire after we stop
        logging.getLogger("asyncio").addFilter(RateLimitFilter(interval, ACCEPT_ERRORS))
        refusal_log.addFilter(RateLimitFilter(interval))
        servers = []
        try:
            for sock in self.config.create_sockets().insecure_sockets:
                servers.append(await asyncio.start_server(self._on_connect, backlog=self.config.backlog, sock=sock))
                log.info(
                    "Running on http://%s (at most %d connections)",
                    repr_socket_addr(sock.family, sock.getsockname()),
                    self.limit,
                )
            await shutdown_trigger()
        finally:
            await self.context.terminated.set()  # idle connections close now; no new requests start
            for server in servers:
                server.close()
            await self._close_connections()

    async def _close_connections(self) -> None:
        if self.connections:
            await asyncio.wait(set(self.connections), timeout=SHUTDOWN_CLOSE)
        for task, conn in list(self.connections.items()):
            conn.abort()
            task.cancel()
        if self.connections:
            await asyncio.wait(set(self.connections), timeout=SHUTDOWN_CLOSE)
        if self.connections:
            log.warning("%d connections did not close at shutdown", len(self.connections))
