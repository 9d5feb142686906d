"""The TokenizerManager's sockets: one PUSH to the Scheduler, two PULLs (from the
Detokenizer and the Scheduler), behind the small interface the TM needs.

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

    def send(self, msg: Message) -> None:
        """To the Scheduler; never blocks the event loop."""

    def reconnect(self) -> None:
        """A new Scheduler: drop what was queued for the old one."""

    async def close(self) -> None: ...


class ZmqTransport:
    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self.ctx = zmq.asyncio.Context()
        self.codec = Codec("tokenizer_manager")
        self.to_scheduler = make_socket(self.ctx, zmq.PUSH, endpoints.scheduler_in, do_bind=False)
        self.pulls = [make_socket(self.ctx, zmq.PULL, endpoints.tm_from_detokenizer, do_bind=True),
                      make_socket(self.ctx, zmq.PULL, endpoints.tm_from_scheduler, do_bind=True)]
        self._tasks: list[asyncio.Task] = []

    def start(self, on_message: Callable[[Message], None]) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop(s, on_message)) for s in self.pulls]

    async def _recv_loop(self, sock: zmq.asyncio.Socket, on_message: Callable[[Message], None]) -> None:
        while True:
            msg = self.codec.decode(await sock.recv())
            if msg is not None:
                on_message(msg)

    def send(self, msg: Message) -> None:
        self.to_scheduler.send(self.codec.encode(msg))

    def reconnect(self) -> None:
        self.to_scheduler.close(linger=0)
        self.to_scheduler = make_socket(self.ctx, zmq.PUSH, self.endpoints.scheduler_in, do_bind=False)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)
