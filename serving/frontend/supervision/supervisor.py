"""The engine supervisor (main process): spawn the engine's children, watch them, recover.

A child that exits, or stops sending heartbeats for `--watchdog-timeout` while requests
are in flight, is an engine failure: every in-flight request ends at once with an
explicit error (SSE error event + [DONE], or 503), /health turns 503, a metric and an
ERROR log line name the process and the cause; then both children are replaced
(`--on-engine-failure restart`, the default) while the HTTP listener stays up, or the
server exits 1 (`exit`).  Both are replaced because their per-rid state only makes sense
together.  Better than SGLang's crash-and-let-an-outside-supervisor-restart: clients get
an answer, not a reset connection.

A restart that fails too (a child dies or is not ready in time) is retried after an
exponential backoff, within a budget of `--max-engine-restarts` attempts per
`--engine-restart-window` seconds.  A spent budget means the engine cannot stay up
(a crash loop): the server then stays up answering 503 with the reason, so probes and
clients see why, instead of exiting into an outside restart loop.  A failure of the
very first start still exits 1: that server never worked, and its operator must see it.

With `--dump-requests` or `--crash-dump-dir`, each failure also leaves a crash dump
(`serving.frontend.supervision.crash_dump`): the state is taken before the requests are failed, the
live children's stacks before they are killed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from serving import startup_phases
from serving.args import ServerArgs
from serving.frontend.supervision.children import spawn, stop_children
from serving.frontend.supervision.crash_dump import CrashDumper
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.ipc import Endpoints
from serving.model_errors import EXIT_KV_EVENTS
from serving.model_files import EXIT_MODEL_LOAD
from telemetry.metrics import Metrics

log = logging.getLogger("sightline.supervisor")
BACKOFF_FIRST = 0.5  # seconds before the first restart in a quiet window; doubles per recent attempt
BACKOFF_MAX = 30.0
Failure = tuple[str, str, str]  # (role, cause, detail)


class Front(Protocol):
    """Who holds the requests: the TokenizerManager, or the hub for its tokenizer workers."""

    def has_in_flight(self) -> bool: ...

    def engine_failed(self, message: str) -> None:
        """End every in-flight request with `message`; forget the dead children and what was queued for them."""


@dataclass
class Supervised:
    args: ServerArgs
    monitor: EngineMonitor
    front: Front
    metrics: Metrics | None
    endpoints: Endpoints
    model_name: str
    crash: CrashDumper | None = None  # --dump-requests / --crash-dump-dir: a dump of each failure


class EngineSupervisor:
    def __init__(self, state: Supervised, instance_id: str, stop: asyncio.Event) -> None:
        self.state = state
        self.monitor = state.monitor
        self.args = state.args
        self.instance_id = instance_id
        self.stop = stop
        self.exit_code = 0
        self.restarts = 0
        self.attempts: deque[float] = deque()  # monotonic times of restart attempts, pruned to the window

    async def start(self) -> Failure | None:
        """Spawn both children and wait for their Ready: None once ready or when the server stops, else the failure."""
        st, mon, loop = self.state, self.monitor, asyncio.get_running_loop()
        startup_phases.begin("spawn")  # the main process's last phase, on its first start only
        mon.expect(spawn(self.args, st.endpoints, self.instance_id))  # only these may report Ready
        deadline = loop.time() + self.args.startup_timeout
        while not mon.all_ready.is_set():
            if self.stop.is_set():  # children still starting hold nothing worth a graceful stop
                stop_children(mon.procs, force=True)
                return None
            for role, p in mon.procs.items():
                if not p.is_alive():
                    if p.exitcode == EXIT_MODEL_LOAD:
                        return role, "exited", "could not load the model (see the error line above)"
                    if p.exitcode == EXIT_KV_EVENTS:
                        return role, "exited", "could not open its KV-events endpoint (see the error line above)"
                    return role, "exited", f"exited with code {p.exitcode} before it was ready"
            if loop.time() > deadline:
                return mon.missing()[0], "startup_timeout", f"was not ready within {self.args.startup_timeout:g} s"
            await asyncio.sleep(0.05)
        clock = startup_phases.clock()
        if clock is not None:
            clock.finish()
        log.info("ready: serving %s on http://%s:%d", st.model_name, self.args.host, self.args.port)
        return None

    def check(self) -> Failure | None:
        """(role, cause, detail) of a failed child, or None."""
        return self.monitor.failed_child(in_flight=self.state.front.has_in_flight())

    async def run(self) -> None:
        """Watch until the server stops; recover from each failure."""
        failure = await self.start()
        if failure is not None:
            role, _, detail = failure
            log.error("%s %s during startup; shutting down", role, detail, extra={"role": role})
            self.exit_code = 1
            self.stop.set()
            return
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
            if self.monitor.shutting_down or self.monitor.down:
                continue
            try:
                failure = self.check()
                if failure is not None and failure[1] == "stalled":
                    # If this loop itself was starved, queued heartbeats are still unread: read them first.
                    await asyncio.sleep(0.2)
                    failure = self.check()
                if failure is not None and not await self.recover(*failure):
                    return
            except Exception:
                log.exception("supervisor error; watching on")

    async def recover(self, role: str, cause: str, detail: str) -> bool:
        """Replace the children until they are ready, within the budget; False when the server must stop."""
        mon, args = self.monitor, self.args
        t0 = time.monotonic()
        while True:
            crash = self.state.crash
            pending = await crash.begin(role, cause, detail) if crash is not None else None  # before it is erased
            self._failed(role, cause, detail)
            if crash is not None:  # the live children's stacks, before they are killed; written in a thread
                await crash.finish(pending)
            await asyncio.to_thread(stop_children, mon.procs, True)
            if args.on_engine_failure == "exit" or self.stop.is_set():
                self.exit_code = 1 if args.on_engine_failure == "exit" else self.exit_code
                self.stop.set()
                return False
            now = time.monotonic()
            while self.attempts and self.attempts[0] <= now - args.engine_restart_window:
                self.attempts.popleft()
            if len(self.attempts) >= args.max_engine_restarts:
                self._give_up()
                return True
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** len(self.attempts))
            attempt = len(self.attempts) + 1
            mon.restarting(
                f"restart attempt {attempt} of at most {args.max_engine_restarts} per {args.engine_restart_window:g} s"
            )
            log.warning(
                "restarting the engine in %.1f s (%s)",
                delay,
                mon.restart_status,
                extra={"attempt": attempt, "backoff_seconds": delay},
            )
            try:
                await asyncio.wait_for(self.stop.wait(), delay)
                return False  # stopping: the server's shutdown stops what is left
            except asyncio.TimeoutError:
                pass
            self.attempts.append(time.monotonic())
            failure = await self.start()
            if self.stop.is_set():
                return False
            if failure is None:
                break
            role, cause, detail = failure
        self.restarts += 1
        mon.recovered()
        if self.state.metrics is not None:
            self.state.metrics.engine_restarts.inc()
            self.state.metrics.engine_recovery.observe(time.monotonic() - t0)
        log.warning(
            "engine restarted in %.1f s after %s %s",
            time.monotonic() - t0,
            role,
            cause,
            extra={"role": role, "cause": cause, "restart_seconds": round(time.monotonic() - t0, 2)},
        )
        return True

    def _failed(self, role: str, cause: str, detail: str) -> None:
        """Announce a failure (ERROR log, metric, /health) and end every request in flight with an error."""
        st = self.state
        self.monitor.failed(f"{role} {detail}")
        log.error("engine failure: %s %s", role, detail, extra={"role": role, "cause": cause})
        if st.metrics is not None:
            st.metrics.engine_failures.labels(role, cause).inc()
        st.front.engine_failed(f"the engine failed ({role} {detail}); the request was not completed")

    def _give_up(self) -> None:
        """The budget is spent: leave the engine down and say so, in /health, every 503, a metric and the log."""
        mon, args = self.monitor, self.args
        mon.give_up(
            f"engine down: the restart budget is spent ({len(self.attempts)} restart attempts within "
            f"{args.engine_restart_window:g} s, --max-engine-restarts {args.max_engine_restarts}); "
            f"last failure: {mon.failure}; restart the server"
        )
        if self.state.metrics is not None:
            self.state.metrics.restart_budget_exhausted.set(1)
        log.error("%s", mon.down, extra={"restart_attempts": len(self.attempts)})
