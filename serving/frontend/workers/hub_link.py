"""A tokenizer worker's view of the engine and its line to the hub (several workers only).

The hub supervises the engine and relays what a worker needs in `EngineStatus` (Ready
facts, health, throughput, a failure), so the TokenizerManager validates and admits
exactly as with one worker: `HubLink` implements `engine_state.EngineState`, as the
`EngineMonitor` does.
It also answers the hub's `SnapshotReq` (this worker's metrics, a rid's timeline entry,
its recent or in-flight requests, or a control order it applies) and sends `HubQuery`s for the answers only the hub
can give over every worker (`/metrics`, `/debug/state`, `/debug/requests[/{rid}]`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from typing import Any, Callable

from protocol.io_struct import EngineStatus, HubQuery, HubReply, Ready, Snapshot, SnapshotReq, WorkerStats
from serving.frontend.engine_state import FrontCounts
from serving.frontend.errors import APIError
from telemetry.metrics import Metrics
from telemetry.registry_merge import snapshot
from telemetry.tail_sampling import TailSampler
from telemetry.timeline import Timeline

log = logging.getLogger("sightline.worker")
QUERY_TIMEOUT = 10.0


class _Rate:
    def __init__(self) -> None:
        self.value = 0.0

    def rate(self, now: int | None = None) -> float:
        return self.value


class HubLink:
    def __init__(
        self,
        worker: int,
        send: Callable[[Any], None],
        metrics: Metrics | None,
        timeline: Timeline,
        tail: TailSampler | None = None,
    ) -> None:
        self.worker = worker
        self.tail = tail  # its decisions go to the hub, which holds the engine's spans of this worker's requests
        if tail is not None:
            tail.outbox = ([], [])
        self.send = send  # to the hub
        self.metrics = metrics
        self.timeline = timeline
        self.status: EngineStatus | None = None
        self.generation: int | None = None
        self.throughput = _Rate()
        self._shutting_down = False
        self.on_failure: Callable[[str], None] = lambda message: None  # the TM's engine_failed
        self.in_flight: Callable[[int], list[dict]] = lambda limit: []  # ServerState.in_flight_requests
        self.on_control: Callable[[dict], dict] = lambda order: {}  # routes.control.apply_order
        self._queries: dict[str, asyncio.Future[HubReply]] = {}
        self._finished = 0  # the TM's finished-request count at the last metrics push

    # -- from the hub ---------------------------------------------------------------
    def handle(self, msg: Any) -> bool | None:
        if isinstance(msg, EngineStatus):
            self._status(msg)
        elif isinstance(msg, SnapshotReq):
            self.send(self._snapshot(msg))
        elif isinstance(msg, HubReply):
            fut = self._queries.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            return None
        return True

    def _status(self, msg: EngineStatus) -> None:
        if self.generation is not None and msg.generation != self.generation and msg.failure:
            self.on_failure(msg.failure)  # the engine was replaced: what this worker had in flight is lost
        self.generation = msg.generation
        self.status = msg
        self.throughput.value = msg.throughput

    def _snapshot(self, req: SnapshotReq) -> Snapshot:
        if req.kind == "metrics":
            return Snapshot(
                id=req.id, worker=self.worker, families=snapshot(self.metrics.registry) if self.metrics else []
            )
        if req.kind == "requests":  # arg: {"limit": n, "in_flight": bool}
            q = json.loads(req.arg)
            found = self.in_flight(q["limit"]) if q["in_flight"] else self.timeline.recent(q["limit"])
            return Snapshot(id=req.id, worker=self.worker, entry=json.dumps(found).encode())
        if req.kind == "control":  # the hub's order for an operator action: apply it, say what was done
            done = self.on_control(json.loads(req.arg))
            return Snapshot(id=req.id, worker=self.worker, entry=json.dumps(done).encode())
        entry = self.timeline.get(req.arg) if req.kind == "request" else None
        return Snapshot(id=req.id, worker=self.worker, entry=json.dumps(entry).encode() if entry else b"")

    # -- to the hub -----------------------------------------------------------------
    def heartbeat(self, in_flight: int, front: FrontCounts, finished: int) -> None:
        """WorkerStats; and, when requests finished since the last one, this worker's metrics, so a
        worker killed between scrapes loses at most a heartbeat's worth of counts."""
        if finished != self._finished and self.metrics is not None:
            self._finished = finished
            self.send(Snapshot(id="", worker=self.worker, families=snapshot(self.metrics.registry)))
        kept, dropped = self.tail.take_outbox() if self.tail is not None else ([], [])
        self.send(
            WorkerStats(
                worker=self.worker,
                pid=os.getpid(),
                in_flight=in_flight,
                oldest_arrival=front.oldest_arrival,
                stale_drops=front.stale_drops,
                undecodable=front.undecodable,
                handling_errors=front.handling_errors,
                decode_gaps=front.decode_gaps,
                tail_kept=kept,
                tail_dropped=dropped,
            )
        )

    async def query(self, kind: str, arg: str = "") -> HubReply:
        qid = uuid.uuid4().hex
        fut = self._queries[qid] = asyncio.get_running_loop().create_future()
        try:
            self.send(HubQuery(id=qid, worker=self.worker, kind=kind, arg=arg))
            return await asyncio.wait_for(fut, QUERY_TIMEOUT)
        except asyncio.TimeoutError:
            raise APIError(503, "the server's hub did not answer", type="server_unavailable") from None
        finally:
            del self._queries[qid]

    # -- what the TokenizerManager and /health read (engine_state.EngineState) ----------------
    @property
    def ready(self) -> list[Ready]:
        return self.status.ready if self.status else []

    @property
    def engine_ready(self) -> Ready | None:
        return next((r for r in self.ready if r.role != "detokenizer"), None)

    @property
    def paused(self) -> str | None:
        return self.status.paused if self.status else None  # the hub's, relayed in each status

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def down_at(self) -> int | None:
        return self.status.down_at if self.status else None

    @property
    def procs(self) -> dict:
        return {}  # the engine's processes are the hub's

    def begin_shutdown(self) -> None:
        self._shutting_down = True

    def reset(self) -> None:
        """The TM's reset_engine: the hub's next status says what the new engine is."""

    def health(self, oldest_arrival: int | None) -> tuple[bool, str]:
        if self.shutting_down:
            return False, "shutting down"
        if self.status is None:
            return False, "starting: waiting for the hub"
        if self.status.unavailable:
            return False, self.status.unavailable
        return True, "ok"
