"""Admission: how much the front end lets in, and the 429 it answers when full.

Two limits, both checked before anything is sent to the engine: requests still
waiting for their first output (`--max-queued-requests`) and the KV tokens the
in-flight requests are expected to need (`--max-inflight-tokens`), each request counted
as the Scheduler's admission first estimates it (`ServerArgs.expected_tokens`: its
prompt plus, with --admission estimate, --init-new-token-ratio × min(max_tokens,
--new-token-clip); the whole max_tokens with --admission reserve).  So a client that
sets no max_tokens costs what the engine expects of it, not the context window.  A 429
carries a Retry-After estimated from the recent token rate, as a client's backoff hint.
"""

from __future__ import annotations

from typing import Callable

from serving.frontend.errors import APIError
from telemetry.clock import now_ns


class Admission:
    def __init__(
        self, max_queued: int, max_tokens: int, token_rate: Callable[[int], float], on_shed: Callable[[str], None]
    ) -> None:
        self.max_queued = max_queued
        self.max_tokens = max_tokens
        self.token_rate = token_rate  # tokens/s at a monotonic ns time (EngineMonitor.throughput.rate)
        self.on_shed = on_shed  # telemetry: one shed request, by reason
        self.num_queued = 0  # admitted, no output yet
        self.inflight_tokens = 0

    def check_queue(self) -> None:
        if self.num_queued >= self.max_queued:
            raise self._overloaded("queue_full", f"{self.num_queued} requests are already waiting")

    def check_tokens(self, budget: int, others_in_flight: bool) -> None:
        """A request alone is always let in (the context window bounds it); else the total is capped."""
        if others_in_flight and self.inflight_tokens + budget > self.max_tokens:
            raise self._overloaded("tokens_full", f"{self.inflight_tokens} KV tokens are expected in flight")

    def admit(self, budget: int) -> None:
        self.num_queued += 1
        self.inflight_tokens += budget

    def started(self) -> None:
        """The request's first output arrived: it no longer waits."""
        self.num_queued -= 1

    def release(self, budget: int, started: bool) -> None:
        if not started:
            self.num_queued -= 1
        self.inflight_tokens -= budget

    def _overloaded(self, reason: str, detail: str) -> APIError:
        rate = self.token_rate(now_ns())
        wait = self.inflight_tokens / rate if rate > 0 else 1.0
        retry_after = str(max(1, min(60, int(wait) + 1)))
        self.on_shed(reason)
        return APIError(
            429,
            f"server overloaded: {detail}; retry after {retry_after} s",
            type="overloaded_error",
            code=reason,
            headers={"retry-after": retry_after},
        )
