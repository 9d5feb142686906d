"""Waiting for one reply from every Scheduler rank to a request the TokenizerManager broadcast
(flush the prefix cache, the step timeline, a barrier): the replies are keyed (by rank, or by
(rank, path) for a barrier's three paths) and handed over together, in key order, once all
have arrived, so a caller's `asyncio.wait_for` covers the slowest rank.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from protocol.io_struct import FlushCacheReqOutput


class RankReplies:
    def __init__(self, expected: int, combine: Callable[[list], Any] = list) -> None:
        """`expected`: how many replies make it complete; `combine`: what the waiter gets from them (in key
        order), the list itself by default."""
        self.replies: dict[Any, Any] = {}
        self.expected = expected
        self.combine = combine
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def add(self, key: Any, reply: Any) -> None:
        self.replies[key] = reply
        if len(self.replies) == self.expected and not self.done.done():
            self.done.set_result(self.combine([self.replies[k] for k in sorted(self.replies)]))


def combine_flushes(replies: list[FlushCacheReqOutput]) -> FlushCacheReqOutput:
    """Every rank's FlushCacheReqOutput as one: a success when every rank flushed."""
    failed = [r for r in replies if not r.success]
    return FlushCacheReqOutput(
        id=replies[0].id,
        success=not failed,
        message=failed[0].message if failed else "",
        flushed_tokens=sum(r.flushed_tokens for r in replies),
    )
