"""The hub's side of the control POSTs with several tokenizer workers.

A worker checks the body and hands the action over (`HubQuery` kind `control`); here the
hub, which owns the `EngineMonitor`, sets the pause state and sends every worker an
`EngineStatus` that carries it (as each heartbeat's does, so a worker started later
learns it too), then, on the same socket so after that status, orders every worker that
is up to apply its part (`SnapshotReq` kind `control`, applied by `routes.control.apply_order`: its own
requests, tracer, log level, and the engine message to every rank), and waits for each
worker's answer and, for a pause in place or its end, for every rank's stats to confirm
(what a pause or resume orders is `serving.frontend.pause.PauseController`'s, as alone).
The reply is 200 once all confirmed; else 503 `control_unconfirmed` naming the workers
and ranks that did not (what was applied stays applied: retrying confirms it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

from protocol.io_struct import HubReply, Snapshot
from serving.frontend.errors import APIError
from serving.frontend.pause import PauseController, PauseOrder, unconfirmed_ranks
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.frontend.workers.fleet import WorkerFleet
from serving.ipc import engine_roles

log = logging.getLogger("sightline.control")


class ControlRelay:
    """The hub's pieces it uses: its monitor, its fleet, `Hub.gather` and `Hub.send_status`."""

    def __init__(
        self,
        monitor: EngineMonitor,
        fleet: WorkerFleet,
        gather: Callable[[str, str], Awaitable[dict[int, Snapshot]]],
        send_status: Callable[[], None],
    ) -> None:
        self.monitor, self.fleet, self.gather, self.send_status = monitor, fleet, gather, send_status
        self._lock = asyncio.Lock()  # one action at a time: a pause and a resume never interleave
        self.pauses = PauseController(monitor, HubPause(self))

    async def answer(self, arg: str) -> HubReply:
        query = json.loads(arg)
        action = query.pop("action")
        async with self._lock:
            try:
                if action.startswith("pause_"):
                    result = await self.pauses.pause(query["mode"])
                elif action == "continue":
                    result = await self.pauses.resume()
                else:  # tracing, log_level: only the workers (and the ranks, via them) hold those settings
                    result = await self._everywhere(query, action)
            except APIError as err:
                return HubReply(id="", status=err.status, body=json.dumps(err.body()).encode())
        return HubReply(id="", body=json.dumps(result).encode())

    # -- the actions ------------------------------------------------------------------------
    async def _everywhere(self, params: dict, action: str) -> dict:
        answers = await self.order(params, None, action)
        previous = answers[min(answers)]["previous"] if answers else None
        result = {**params, "previous": previous, "workers": sorted(answers)}
        if action == "log_level":
            logging.getLogger().setLevel(params["level"].upper())  # the hub's own too
            result["processes"] = [
                "hub",
                *(f"worker-{w}" for w in sorted(answers)),
                *engine_roles(self.monitor.dp_size)[:-1],
            ]
        return result

    # -- ordering and confirming ------------------------------------------------------------------
    async def order(self, order: dict, rank_epoch: int | None, what: str) -> dict[int, dict]:
        """Every worker's answer to `order`; with `rank_epoch`, also wait until every rank's stats show
        that pause epoch (0: stepping). Raises 503 naming who did not confirm."""
        self.send_status()  # the pause state first: a worker answering the order applied it
        expected = {w.id for w in self.fleet.up()}
        got = await self.gather("control", json.dumps(order))
        answers = {wid: json.loads(snap.entry) for wid, snap in got.items()}
        missing = [f"worker-{w}" for w in sorted(expected - answers.keys())]
        if rank_epoch is not None:
            missing += await unconfirmed_ranks(self.monitor, rank_epoch)
        if missing:
            raise APIError(
                503,
                f"the {what} was not confirmed by {', '.join(missing)}; what the others confirmed "
                "stays applied, retry to confirm",
                type="server_unavailable",
                code="control_unconfirmed",
            )
        return answers


class HubPause:
    """The pause driver of the hub: every worker applies the order, and every rank confirms."""

    unpause_first = True  # the order travels behind the status that carries the pause state

    def __init__(self, relay: ControlRelay) -> None:
        self.relay = relay

    def state_changed(self) -> None:
        """Nothing yet: the status sent ahead of the order carries it."""

    async def apply(self, order: PauseOrder, what: str) -> dict:
        answers = await self.relay.order(
            {"abort": order.abort, "engine": order.engine, "epoch": order.epoch},
            order.epoch if order.engine else None,
            what,
        )
        return {
            "aborted": _sum(answers, "aborted"),
            "in_flight": _sum(answers, "in_flight"),
            "workers": sorted(answers),
        }


def _sum(answers: dict[int, dict], key: str) -> int:
    return sum(a.get(key, 0) for a in answers.values())
