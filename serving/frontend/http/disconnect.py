"""Waiting for a whole (non-streamed) result while watching the client: if it disconnects first, the
work is cancelled and its requests aborted (`on_gone`), and the caller answers 499."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from starlette.requests import Request


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def await_or_abort(request: Request, work: Awaitable, on_gone: Callable[[], None]):
    """`work`'s result; None (after `on_gone`) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            on_gone()
    return task.result() if task in done else None
