"""Server-sent events: the `data:` framing and a streaming response that always cleans up."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

import msgspec
from starlette.responses import StreamingResponse

from serving.frontend.http.server import EXTENSION as TRANSPORT

_json = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A stream that runs `on_close` however it ends, even if it never started.

    Its sends may block for at most the request's remaining timeout (+1 s to deliver the
    timeout error) or `--send-stall-timeout`: then the transport cuts the stream off and
    `on_close` aborts the request (`serving.frontend.http.server.Stream`).
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str],
        timeout: float | None,
    ) -> None:
        self._timeout = timeout
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            transport = scope.get("extensions", {}).get(TRANSPORT)
            if transport is not None and self._timeout:
                transport.deadline = asyncio.get_running_loop().time() + self._timeout
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
