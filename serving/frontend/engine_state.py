"""What a front end knows about the engine, whoever knows it: the `EngineState` Protocol.

A single-process server's TokenizerManager reads the `EngineMonitor` (it hears the
children itself); a tokenizer worker's reads its `HubLink` (the hub hears them and relays
`EngineStatus`).  The TokenizerManager, the routes and the drain depend on this Protocol
only.  `check_available` is the one availability decision of the request path: whether a
new request may go to the engine now, and which 503 it gets if not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.io_struct import DropCount, GapCount, HubReply, Ready
from serving.frontend.errors import paused_error, starting, unavailable

PAUSED = "paused"  # the health reason while an operator paused generation


@dataclass
class FrontCounts:
    """What a TokenizerManager counts about its own side of the sockets."""

    stale_drops: list[DropCount] = field(default_factory=list)
    undecodable: int = 0
    handling_errors: int = 0
    oldest_arrival: int | None = None  # of the requests in flight (None: idle)
    decode_gaps: list[GapCount] = field(default_factory=list)  # downstream of the Scheduler (telemetry.downstream_gaps)


class Rate(Protocol):
    def rate(self, now: int) -> float: ...


class EngineState(Protocol):
    """The engine as a TokenizerManager sees it (implemented by EngineMonitor and HubLink)."""

    @property
    def engine_ready(self) -> Ready | None:
        """Rank 0's Ready once every engine process is ready (the facts requests are validated
        against: context length, vocabulary, dtype); None while none runs."""

    @property
    def paused(self) -> str | None:
        """The pause mode an operator set, None while serving."""

    @property
    def shutting_down(self) -> bool: ...

    @property
    def down_at(self) -> int | None:
        """Monotonic ns when the restart budget was spent (the engine stays down for good); None before."""

    @property
    def throughput(self) -> Rate:
        """Output tokens/s over the last few seconds (admission's wait estimate)."""

    @property
    def procs(self) -> dict[str, Any]:
        """The engine's processes by role (empty where another process supervises them)."""

    def health(self, oldest_arrival: int | None) -> tuple[bool, str]:
        """(healthy, reason): what /health says and what `check_available` decides on."""

    def handle(self, msg: Any) -> bool | None:
        """Apply a message from the engine or the hub: True applied, False refused, None not this one's."""

    def reset(self) -> None:
        """The engine is being replaced: forget what the old one said."""

    def begin_shutdown(self) -> None:
        """From now on the server is shutting down: every new request gets 503."""


class Hub(Protocol):
    """A tokenizer worker's line to the hub, for the answers only the hub has over every worker
    (`/metrics`, `/debug/state`, `/debug/requests[/{rid}]`)."""

    worker: int

    async def query(self, kind: str, arg: str = "") -> HubReply: ...


def check_available(engine: EngineState, oldest_arrival: int | None) -> Ready:
    """The engine's Ready if a new request may go to it now; else the 503 that says why (starting,
    paused with Retry-After, shutting down, failed, restarting, stuck)."""
    ok, reason = engine.health(oldest_arrival)
    if not ok:
        raise paused_error(engine.paused) if reason == PAUSED else unavailable(reason)
    return require_engine(engine)


def require_engine(engine: EngineState) -> Ready:
    """The engine's Ready, or the 503 `starting` while none is ready (for what needs a running engine
    whatever else holds: a flush of the prefix cache, an in_place pause)."""
    ready = engine.engine_ready
    if ready is None:
        raise starting()
    return ready
