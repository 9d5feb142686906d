"""The engine supervisor (main process): spawn the children, watch them, recover.

A child that exits, or stops sending heartbeats for `--watchdog-timeout` while requests
are in flight, is an engine failure: every in-flight request ends at once with an
explicit error (SSE error event + [DONE], or 503), /health turns 503, a metric and an
ERROR log line name the process and the cause; then both children are replaced
(`--on-engine-failure restart`, the default) while the HTTP listener stays up, or the
server exits 1 (`exit`).  Both are replaced because their per-rid state only makes sense
together.  Better than the seed's crash-and-let-the-supervisor-restart: clients get an
answer, not a reset connection.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time

from serving.args import ServerArgs
from serving.detokenizer import run_detokenizer_process
from serving.ipc import Endpoints
from serving.scheduler import run_scheduler_process
from serving.server_state import ServerState
from telemetry.clock import now_ns

log = logging.getLogger("sightline.supervisor")
CHILD_STOP_TIMEOUT = 5.0
ROLES = ("scheduler", "detokenizer")


def spawn(args: ServerArgs, endpoints: Endpoints, instance_id: str) -> dict[str, mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    targets = {"scheduler": run_scheduler_process, "detokenizer": run_detokenizer_process}
    procs = {role: ctx.Process(target=targets[role], args=(args, endpoints, instance_id),
                               name=f"sightline-{role}", daemon=True) for role in ROLES}
    for p in procs.values():
        p.start()
    return procs


def stop_children(procs: dict[str, mp.process.BaseProcess], force: bool = False) -> None:
    """SIGTERM (or SIGKILL when `force`: a stalled child may not be able to stop), then reap."""
    for p in procs.values():
        if p.is_alive():
            p.kill() if force else p.terminate()
    for role, p in procs.items():
        p.join(CHILD_STOP_TIMEOUT)
        if p.is_alive():
            log.warning("%s did not stop in %.0f s; killing it", role, CHILD_STOP_TIMEOUT)
            p.kill()
            p.join()


class EngineSupervisor:
    def __init__(self, state: ServerState, instance_id: str, stop: asyncio.Event) -> None:
        self.state = state
        self.args = state.args
        self.instance_id = instance_id
        self.stop = stop
        self.exit_code = 0
        self.restarts = 0

    async def start(self) -> bool:
        """Spawn both children and wait for their Ready; False if one dies or time runs out."""
        st, loop = self.state, asyncio.get_running_loop()
        st.procs = spawn(self.args, st.endpoints, self.instance_id)
        deadline = loop.time() + self.args.startup_timeout
        while not st.tm.all_ready.is_set():
            dead = [role for role, p in st.procs.items() if not p.is_alive()]
            if dead or loop.time() > deadline:
                log.error("%s; shutting down", f"{dead[0]} exited during startup" if dead else "startup timed out")
                return False
            await asyncio.sleep(0.05)
        log.info("ready: serving %s on http://%s:%d", st.model_name, self.args.host, self.args.port)
        return True

    def check(self) -> tuple[str, str, str] | None:
        """(role, cause, detail) of a failed child, or None."""
        st = self.state
        for role, p in st.procs.items():
            if not p.is_alive():
                return role, "exited", f"exited with code {p.exitcode}"
        if st.tm.all_ready.is_set() and st.tm.rid_to_state:
            now = now_ns()
            for role in ROLES:
                age = (now - st.tm.last_heartbeat.get(role, now)) / 1e9
                if age > self.args.watchdog_timeout:
                    return role, "stalled", f"sent no heartbeat for {age:.1f} s with requests in flight"
        return None

    async def run(self) -> None:
        """Watch until the server stops; recover from each failure."""
        if not await self.start():
            self.exit_code = 1
            self.stop.set()
            return
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
            if self.state.shutting_down:
                continue
            try:
                failure = self.check()
                if failure is not None and failure[1] == "stalled":
                    # If this loop itself was starved, queued heartbeats are still unread: read them first.
                    await asyncio.sleep(0.2)
                    failure = self.check()
                if failure is not None and not await self.recover(*failure):
                    return
            except Exception:  # noqa: BLE001 - the watchdog itself must never die quietly
                log.exception("supervisor error; watching on")

    async def recover(self, role: str, cause: str, detail: str) -> bool:
        st = self.state
        t0 = time.monotonic()
        st.engine_failure = f"{role} {detail}"
        log.error("engine failure: %s %s", role, detail, extra={"role": role, "cause": cause})
        if st.metrics is not None:
            st.metrics.get("sightline_engine_failures_total").labels(role, cause).inc()
        st.tm.abort_all("engine_failure", f"the engine failed ({role} {detail}); the request was not completed")
        st.tm.reset_engine()
        await asyncio.to_thread(stop_children, st.procs, True)
        if self.args.on_engine_failure == "exit" or self.stop.is_set():
            self.exit_code = 1 if self.args.on_engine_failure == "exit" else self.exit_code
            self.stop.set()
            return False
        if not await self.start():
            self.exit_code = 1
            self.stop.set()
            return False
        self.restarts += 1
        st.engine_failure = None
        if st.metrics is not None:
            st.metrics.get("sightline_engine_restarts_total").inc()
        log.warning("engine restarted in %.1f s after %s %s", time.monotonic() - t0, role, cause,
                    extra={"role": role, "cause": cause, "restart_seconds": round(time.monotonic() - t0, 2)})
        return True
