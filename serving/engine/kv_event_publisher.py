"""The Scheduler's KV-event publisher: a ZMQ PUB socket and a replay ROUTER, vLLM's framing
(`protocol.kv_events`), run by a thread of its own so that no subscriber can slow a step.

The Scheduler hands each step's events to `publish`, which only puts them on a bounded queue
(a full queue drops the batch, counted) and rings an eventfd.  The thread sleeps in one poll over
that eventfd, the replay socket and the PUB socket, so it wakes only when there is work (a batch,
a replay request, a subscription, a stop), never on a timer.  It numbers each batch (its sequence number,
from 0), encodes it, keeps the last `BUFFER_STEPS` for replay and sends it without blocking.
The PUB side is an XPUB with `XPUB_NODROP`: when any subscriber's high-water mark is reached
the send fails at once instead of ZMQ dropping silently, so the batch is counted as dropped
(still kept for replay, so a subscriber that sees a gap in the sequence numbers gets it back).

Endpoints as vLLM reads them: one with `*`, `::`, `ipc://` or `inproc://` is bound, any other
connected to (a router that binds, as llm-d's indexer does).  Rank r > 0 of `--dp-size` adds r
to the port (or `_dp{r}` to an inproc name).  Opening fails with `KVEventsError`, one line for
the operator, when a bound address is taken or not local, or a connection is not made within
the connect timeout: the Scheduler exits before loading the model and the server stops.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.kv_events import END_SEQ, KVEvent, KVEventBatch, seq_frame
from serving.args import ServerArgs
from serving.engine.kv_events import KVEventRecorder
from serving.engine.radix_cache import RadixCache

log = logging.getLogger(__name__)
BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)
QUEUE_BATCHES = 10_000  # batches waiting for the thread before new ones are dropped


class KVEventsError(Exception):
    """A KV-events endpoint that cannot be opened; its message is one line meant for operators."""


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Rank `rank`'s endpoint: its port plus the rank (tcp), the name plus `_dp{rank}` (inproc, ipc)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise KVEventsError(f"KV-events endpoint {endpoint!r}: expected tcp://host:port, ipc:// or inproc://")
    return f"{base}:{int(port) + rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and local transports are bound, a named host is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _connect_within(sock: zmq.Socket, endpoint: str, timeout: float) -> None:
    """Connect and wait for the TCP connection (a router that is not there fails the start, not later)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    try:
        sock.connect(endpoint)
        if timeout > 0 and not monitor.poll(int(timeout * 1000)):
            raise KVEventsError(
                f"KV-events endpoint {endpoint}: no subscriber accepted the connection within "
                f"{timeout:g} s (--kv-events-connect-timeout)"
            )
        if timeout > 0:
            recv_monitor_message(monitor)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        rank: int = 0,
        hwm: int = 100_000,
        connect_timeout: float = 10.0,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.rank = rank
        self.endpoint = offset_endpoint(endpoint, rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, rank) if replay_endpoint else None
        self.topic = topic.encode()
        self.published = 0  # events sent to every subscriber (cumulative)
        self.dropped = 0  # events of batches a full queue or a subscriber's high-water mark refused
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(QUEUE_BATCHES)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # rung once per queued batch (or the stop)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._ctx = ctx or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self._open(connect_timeout)
        except Exception:
            self.close()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _open(self, connect_timeout: float) -> None:
        where = "endpoint"
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                _connect_within(self._pub, self.endpoint, connect_timeout)
            if self.replay_endpoint:
                where = "replay endpoint"
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            address = self.replay_endpoint if where == "replay endpoint" else self.endpoint
            raise KVEventsError(f"KV-events {where} {address}: {exc.strerror}") from None

    # -- the Scheduler's side -------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events; never waits (a full queue drops them, counted)."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += len(events)
            return
        os.eventfd_write(self._wake, 1)

    @property
    def backlog(self) -> int:
        """Batches queued for the thread, not yet sent or dropped."""
        return self._queue.qsize()

    def stats(self) -> dict[str, int]:
        """Its part of `SchedulerStats`, by field name."""
        return {"kv_events_published_total": self.published, "kv_events_dropped_total": self.dropped}

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            os.eventfd_write(self._wake, 1)
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            if self._wake >= 0:
                os.close(self._wake)
                self._wake = -1

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        encoder, seq = msgspec.msgpack.Encoder(), 0
        poller = zmq.Poller()
        poller.register(self._wake, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)  # subscription messages, read and forgotten
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is self._replay:
                    self._serve_replay()
                elif sock is self._pub:
                    self._pub.recv(zmq.NOBLOCK)
            try:  # reset the counter before reading the queue: a batch queued after this rings again
                os.eventfd_read(self._wake)
            except BlockingIOError:  # woken by a socket, no batch rang
                pass
            while True:  # every batch queued so far (one ring may stand for several)
                try:
                    events = self._queue.get_nowait()
                except queue.Empty:
                    break
                if events is None:
                    return
                payload = encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank))
                self._buffer.append((seq, payload))
                try:
                    self._pub.send_multipart((self.topic, seq_frame(seq), payload), zmq.NOBLOCK)
                    self.published += len(events)
                except zmq.Again:  # a subscriber is full: nobody gets it now, every one can replay it
                    self.dropped += len(events)
                seq += 1

    def _serve_replay(self) -> None:
        """One replay request: (identity, b"", start seq) → each buffered batch from it on, then END_SEQ."""
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV-events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq_frame(seq), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", END_SEQ, b""))  # type: ignore[union-attr]


class KVEvents:
    """`--kv-events-endpoint` in the Scheduler: the recorder the prefix cache tells of its changes
    (`serving.engine.kv_events`) and the publisher its events leave through, once per loop turn."""

    def __init__(self, recorder: KVEventRecorder, publisher: KVEventPublisher) -> None:
        self.recorder = recorder
        self.publisher = publisher

    @classmethod
    def open(cls, args: ServerArgs, rank: int) -> KVEvents | None:
        """None when the flag is off; raises KVEventsError when an endpoint cannot be opened."""
        if not args.kv_events_endpoint:
            return None
        publisher = KVEventPublisher(
            args.kv_events_endpoint,
            args.kv_events_replay_endpoint,
            args.kv_events_topic,
            rank,
            args.kv_events_hwm,
            args.kv_events_connect_timeout,
        )
        recorder = KVEventRecorder(args.kv_events_block_size, args.kv_events_hash_seed, args.kv_events_token_ids)
        return cls(recorder, publisher)

    def watch(self, tree: RadixCache | None) -> None:
        """Report `tree`'s changes from now on, starting with a clear: a Scheduler that starts (or restarts after
        a failure) holds no block, whatever a router remembers of this endpoint."""
        if tree is not None:
            tree.events = self.recorder
        self.recorder.cleared()

    def send(self) -> None:
        if self.recorder.pending:
            self.publisher.publish(self.recorder.drain())

    @staticmethod
    def stats_of(events: KVEvents | None) -> dict[str, int]:
        """Their part of `SchedulerStats` (zeros with the flag off)."""
        if events is None:
            return {"kv_events_published_total": 0, "kv_events_dropped_total": 0}
        return events.publisher.stats()

    def close(self) -> None:
        self.send()
        self.publisher.close()
