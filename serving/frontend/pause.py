"""Pausing and resuming generation: one state machine, whoever drives the engine.

`PauseController` decides what a pause or a resume means from the pause in effect: the
monitor's new pause mode, whether every request in flight ends (mode abort), which message
every Scheduler rank gets (a new pause epoch when an in_place pause starts, a continue when
one ends) and the epoch every rank must then confirm in its stats (`unconfirmed_ranks`,
within `CONFIRM_TIMEOUT`).  A driver carries that out: alone, the process's own
TokenizerManager (`routes.control.LocalPause`); with several tokenizer workers, the hub,
which orders every worker (`workers.control_relay.HubPause`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from serving.frontend.engine_state import require_engine
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.ipc import scheduler_role

CONFIRM_TIMEOUT = 5.0  # seconds every Scheduler rank has to confirm a pause in place or its end


@dataclass
class PauseOrder:
    abort: bool = False  # end every request in flight (mode abort)
    engine: str | None = None  # "pause" (PauseReq of `epoch`) or "continue" (ContinueReq) to every rank
    epoch: int = 0  # what every rank's stats must then show (0: stepping)


class PauseDriver(Protocol):
    # True: the unpause must precede the order (the hub's order travels behind the status carrying
    # it); False: a resume keeps admission paused until every rank confirmed it
    unpause_first: bool

    def state_changed(self) -> None:
        """The monitor's pause mode changed (show it)."""

    async def apply(self, order: PauseOrder, what: str) -> dict:
        """Carry `order` out and confirm it (503 `control_unconfirmed` otherwise); the response's
        `aborted` and `in_flight` (and whatever else the driver reports)."""


class PauseController:
    def __init__(self, monitor: EngineMonitor, driver: PauseDriver) -> None:
        self.monitor, self.driver = monitor, driver

    async def pause(self, mode: str) -> dict:
        """Put the server in pause `mode` (see routes.control); what it did, for the response."""
        mon = self.monitor
        previous = mon.paused
        if mode == "in_place":
            require_engine(mon)  # 503 while no engine runs: nothing to pause in place
        mon.pause(mode)  # from here new generation requests get 503 paused
        self.driver.state_changed()
        order = PauseOrder(abort=mode == "abort")
        if mode == "in_place" and previous != "in_place":
            order.engine, order.epoch = "pause", mon.next_pause_epoch()
        elif mode != "in_place" and previous == "in_place":  # what is left steps again (or is aborted)
            order.engine = "continue"
            mon.stepping_again()  # the stall clock starts again from here, not from the last token
        return {"mode": mode, "previous": previous, **await self.driver.apply(order, "pause")}

    async def resume(self) -> dict:
        mon = self.monitor
        previous = mon.paused
        order = PauseOrder()
        if previous == "in_place":
            order.engine = "continue"
            mon.stepping_again()
        if self.driver.unpause_first:
            self._unpause()
        done = await self.driver.apply(order, "resume")
        if not self.driver.unpause_first:
            self._unpause()
        done.pop("aborted", None)
        return {"resumed": previous, **done}

    def _unpause(self) -> None:
        self.monitor.unpause()
        self.driver.state_changed()


async def unconfirmed_ranks(monitor: EngineMonitor, epoch: int) -> list[str]:
    """The ranks whose stats did not show pause `epoch` (0: stepping) within CONFIRM_TIMEOUT."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONFIRM_TIMEOUT
    while not monitor.ranks_paused(epoch) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    stats = monitor.scheduler_stats
    return [
        scheduler_role(r, monitor.dp_size)
        for r in range(monitor.dp_size)
        if stats.get(r) is None or stats[r].paused != epoch
    ]
