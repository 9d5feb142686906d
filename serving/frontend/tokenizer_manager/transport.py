"""The TokenizerManager's sockets: one PUSH per Scheduler rank, a PULL for its outputs and,
alone, a PULL for the children's control messages; as one of several tokenizer workers,
a PUSH to the hub instead (which owns the control socket and relays what a worker needs).

The TM takes any `EngineTransport`, so its admission, abort, stale-drop and finish
logic can be driven without processes (tests/unit); `ZmqTransport` is the real one.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

import zmq
import zmq.asyncio

from protocol.io_struct import Message
from serving.ipc import Codec, Endpoints, make_socket


class EngineTransport(Protocol):
    codec: Codec  # counts what could not be decoded (and, via the TM, what was unexpected)

    def start(self, on_message: Callable[[Message], None]) -> None:
        """Call `on_message` for every decoded message from the children, on the event loop."""

    def send(self, msg: Message, dp_rank: int = 0) -> None:
        """To Scheduler rank `dp_rank`; never blocks the event loop."""

    def to_hub(self, msg: Message) -> None:
        """To the hub (a tokenizer worker's only)."""

    def reconnect(self) -> None:
        """New Schedulers: drop what was queued for the old ones."""

    async def close(self) -> None: ...


class ZmqTransport:
    def __init__(self, endpoints: Endpoints, dp_size: int = 1, worker: int | None = None) -> None:
        """`worker`: this process's id as one of several tokenizer workers; None when it is the only one."""
        self.endpoints = endpoints
        self.dp_size = dp_size
        self.ctx = zmq.asyncio.Context()
        self.codec = Codec("tokenizer_manager")
        self.to_scheduler = self._connect()
        self.pulls = [make_socket(self.ctx, zmq.PULL, endpoints.worker_in(worker or 0), do_bind=True)]
        self.hub = None
        if worker is None:
            self.pulls.append(make_socket(self.ctx, zmq.PULL, endpoints.control, do_bind=True))
        else:
            self.hub = make_socket(self.ctx, zmq.PUSH, endpoints.control, do_bind=False)
        self._tasks: list[asyncio.Task] = []

    def _connect(self) -> list[zmq.asyncio.Socket]:
        return [
            make_socket(self.ctx, zmq.PUSH, self.endpoints.scheduler_in(r), do_bind=False) for r in range(self.dp_size)
        ]

    def start(self, on_message: Callable[[Message], None]) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop(s, on_message)) for s in self.pulls]

    async def _recv_loop(self, sock: zmq.asyncio.Socket, on_message: Callable[[Message], None]) -> None:
        while True:
            msg = self.codec.decode(await sock.recv())
            if msg is not None:
                on_message(msg)

    def send(self, msg: Message, dp_rank: int = 0) -> None:
        self.to_scheduler[dp_rank].send(self.codec.encode(msg))

    def to_hub(self, msg: Message) -> None:
        self.hub.send(self.codec.encode(msg))

    def reconnect(self) -> None:
        for sock in self.to_scheduler:
            sock.close(linger=0)
        self.to_scheduler = self._connect()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)
