"""The hub's side of the control POSTs with several tokenizer workers.

A worker checks the body and hands the action over (`HubQuery` kind `control`); here the
hub, which owns the `EngineMonitor`, sets the pause state and sends every worker an
`EngineStatus` that carries it (as each heartbeat's does, so a worker started later
learns it too), then, on the same socket so after that status, orders every worker that
is up to apply its part (`SnapshotReq` kind `control`, applied by `routes.control.apply_order`: its own
requests, tracer, log level, and the engine message to every rank), and waits for each
worker's answer and, for a pause in place or its end, for every rank's stats to confirm.
The reply is 200 once all confirmed; else 503 `control_unconfirmed` naming the workers
and ranks that did not (what was applied stays applied: retrying confirms it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

from protocol.io_struct import HubReply, Snapshot
from serving.frontend.engine_state import require_engine
from serving.frontend.errors import APIError
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.frontend.workers.fleet import WorkerFleet
from serving.ipc import engine_roles, scheduler_role

log = logging.getLogger("sightline.control")
CONFIRM_TIMEOUT = 5.0  # seconds every Scheduler rank has to confirm a pause in place or its end


class ControlRelay:
    """The hub's pieces it uses: its monitor, its fleet, `Hub.gather` and `Hub.send_status`."""

    def __init__(self, monitor: EngineMonitor, fleet: WorkerFleet,
                 gather: Callable[[str, str], Awaitable[dict[int, Snapshot]]], send_status: Callable[[], None]) -> None:
        self.monitor, self.fleet, self.gather, self.send_status = monitor, fleet, gather, send_status
        self._lock = asyncio.Lock()  # one action at a time: a pause and a resume never interleave

    async def answer(self, arg: str) -> HubReply:
        query = json.loads(arg)
        action = query.pop("action")
        async with self._lock:
            try:
                if action.startswith("pause_"):
                    result = await self._pause(query["mode"])
                elif action == "continue":
                    result = await self._resume()
                else:  # tracing, log_level: only the workers (and the ranks, via them) hold those settings
                    result = await self._everywhere(query, action)
            except APIError as err:
                return HubReply(id="", status=err.status, body=json.dumps(err.body()).encode())
        return HubReply(id="", body=json.dumps(result).encode())

    # -- the actions ------------------------------------------------------------------------
    async def _pause(self, mode: str) -> dict:
        mon = self.monitor
        previous = mon.paused
        if mode == "in_place":
            require_engine(mon)  # 503 while no engine runs: nothing to pause in place
        mon.pause(mode)  # from here every EngineStatus says so
        engine, epoch = None, 0
        if mode == "in_place" and previous != "in_place":
            engine, epoch = "pause", mon.next_pause_epoch()
        elif mode != "in_place" and previous == "in_place":  # what is left steps again (or is aborted)
            engine = "continue"
            mon.stepping_again()
        answers = await self._order({"abort": mode == "abort", "engine": engine, "epoch": epoch},
                                    epoch if engine else None, "pause")
        return {"mode": mode, "previous": previous, "aborted": _sum(answers, "aborted"),
                "in_flight": _sum(answers, "in_flight"), "workers": sorted(answers)}

    async def _resume(self) -> dict:
        mon = self.monitor
        previous = mon.paused
        engine = None
        if previous == "in_place":
            engine = "continue"
            mon.stepping_again()
        mon.unpause()
        answers = await self._order({"engine": engine}, 0 if engine else None, "resume")
        return {"resumed": previous, "in_flight": _sum(answers, "in_flight"), "workers": sorted(answers)}

    async def _everywhere(self, params: dict, action: str) -> dict:
        answers = await self._order(params, None, action)
        previous = answers[min(answers)]["previous"] if answers else None
        result = {**params, "previous": previous, "workers": sorted(answers)}
        if action == "log_level":
            logging.getLogger().setLevel(params["level"].upper())  # the hub's own too
            result["processes"] = ["hub", *(f"worker-{w}" for w in sorted(answers)),
                                   *engine_roles(self.monitor.dp_size)[:-1]]
        return result

    # -- ordering and confirming ------------------------------------------------------------------
    async def _order(self, order: dict, rank_epoch: int | None, what: str) -> dict[int, dict]:
        """Every worker's answer to `order`; with `rank_epoch`, also wait until every rank's stats show
        that pause epoch (0: stepping). Raises 503 naming who did not confirm."""
        self.send_status()  # the pause state first: a worker answering the order applied it
        expected = {w.id for w in self.fleet.up()}
        got = await self.gather("control", json.dumps(order))
        answers = {wid: json.loads(snap.entry) for wid, snap in got.items()}
        missing = [f"worker-{w}" for w in sorted(expected - answers.keys())]
        if rank_epoch is not None:
            missing += await self._ranks_confirm(rank_epoch)
        if missing:
            raise APIError(503, f"the {what} was not confirmed by {', '.join(missing)}; what the others confirmed "
                                "stays applied, retry to confirm", type="server_unavailable",
                           code="control_unconfirmed")
        return answers

    async def _ranks_confirm(self, epoch: int) -> list[str]:
        """The ranks whose stats did not show `epoch` within CONFIRM_TIMEOUT."""
        mon, loop = self.monitor, asyncio.get_running_loop()
        deadline = loop.time() + CONFIRM_TIMEOUT
        while not mon.ranks_paused(epoch) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        stats = mon.scheduler_stats
        return [scheduler_role(r, mon.dp_size) for r in range(mon.dp_size)
                if stats.get(r) is None or stats[r].paused != epoch]


def _sum(answers: dict[int, dict], key: str) -> int:
    return sum(a.get(key, 0) for a in answers.values())
