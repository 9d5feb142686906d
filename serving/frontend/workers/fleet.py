"""The hub's tokenizer workers: spawn them, hear their heartbeats, replace the dead.

A worker that exits (crash, kill -9) takes its client connections with it: those
clients see the connection close at once.  One that is up but sends no heartbeat for
`--watchdog-timeout` (a hung event loop) is killed and handled the same way.  The hub then tells every Scheduler rank
and the Detokenizer (`WorkerGone`) to drop that worker's rids (KV freed, decode state
dropped, nothing sent to a socket no one reads), keeps its counters (`Retired`), and
starts a replacement with a new id, so a late message for the old one can never reach
the new one.  The other workers keep streaming throughout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Callable

import zmq
import zmq.asyncio

from protocol.io_struct import DropCount, EngineStatus, Message, MetricFamily, WorkerGone, WorkerStats
from serving.args import ServerArgs
from serving.frontend.engine_state import FrontCounts
from serving.frontend.supervision.children import spawn_worker, stop_children
from serving.frontend.supervision.engine_monitor import merge_drops
from serving.ipc import Codec, Endpoints, make_socket
from telemetry.downstream_gaps import merge as merge_gaps
from telemetry.registry_merge import Retired

log = logging.getLogger("sightline.fleet")
RESPAWN_BACKOFF = 1.0  # seconds a replacement waits after a worker that lived less than this


@dataclass
class Worker:
    id: int
    proc: BaseProcess
    sock: zmq.asyncio.Socket  # hub → worker
    started: float = field(default_factory=time.monotonic)
    stats: WorkerStats | None = None  # its latest heartbeat; None until it is up
    heard_at: float = 0.0  # monotonic time of that heartbeat
    cause: str = "exited"  # why it is gone: exited, or stalled (killed for its silence)
    metrics: list[MetricFamily] = field(default_factory=list)  # its latest metrics snapshot


class WorkerFleet:
    def __init__(
        self,
        args: ServerArgs,
        endpoints: Endpoints,
        instance_id: str,
        ctx: zmq.asyncio.Context,
        codec: Codec,
        on_failure: Callable[[str], None] = lambda cause: None,
    ) -> None:
        self.args, self.endpoints, self.instance_id = args, endpoints, instance_id
        self.ctx, self.codec = ctx, codec
        self.on_failure = on_failure  # a metric: a worker died (cause)
        self.workers: dict[int, Worker] = {}
        self.next_id = 1  # worker 0 is the single-process TokenizerManager's address
        self.generation = 0  # bumped at each engine failure
        self.failure: str | None = None  # the latest engine failure, sent with its generation
        self.retired = Retired()
        self.retired_front = FrontCounts()
        self.stopping = False
        self.respawn_at: list[float] = []  # monotonic times replacements are due
        # the engine's inputs, for WorkerGone: every Scheduler rank and the Detokenizer
        self.engine = [
            make_socket(ctx, zmq.PUSH, endpoints.scheduler_in(r), do_bind=False) for r in range(args.dp_size)
        ] + [make_socket(ctx, zmq.PUSH, endpoints.detokenizer_in, do_bind=False)]

    # -- lifecycle ------------------------------------------------------------------
    def start(self, n: int) -> None:
        for _ in range(n):
            self._spawn()

    def _spawn(self) -> Worker:
        wid, self.next_id = self.next_id, self.next_id + 1
        proc = spawn_worker(self.args, self.endpoints, self.instance_id, wid)
        w = self.workers[wid] = Worker(
            wid, proc, make_socket(self.ctx, zmq.PUSH, self.endpoints.worker_in(wid), do_bind=False)
        )
        log.info("tokenizer worker %d started (pid %d)", wid, proc.pid)
        return w

    def kill_stalled(self, now: float) -> list[int]:
        """SIGKILL every worker up but silent for --watchdog-timeout (a hung event loop serves no one);
        `reap` then replaces it like any dead worker."""
        stalled = [
            w
            for w in self.workers.values()
            if w.stats is not None
            and w.cause != "stalled"
            and now - w.heard_at > self.args.watchdog_timeout
            and w.proc.is_alive()
        ]
        for w in stalled:
            log.error(
                "tokenizer worker %d sent no heartbeat for %.1f s; killing it",
                w.id,
                now - w.heard_at,
                extra={"worker": w.id},
            )
            w.cause = "stalled"
            w.proc.kill()
        return [w.id for w in stalled]

    def reap(self) -> list[int]:
        """Replace every worker that exited (one that lived under RESPAWN_BACKOFF s: after that long, so a
        crash loop is paced); the ids of those that exited."""
        now = time.monotonic()
        if not self.stopping:
            self.kill_stalled(now)
        dead = [w for w in self.workers.values() if not w.proc.is_alive()]
        for w in dead:
            self._gone(w)
            if not self.stopping:
                self.respawn_at.append(now + (RESPAWN_BACKOFF if now - w.started < RESPAWN_BACKOFF else 0.0))
        due = [t for t in self.respawn_at if t <= now]
        self.respawn_at = [t for t in self.respawn_at if t > now]
        for _ in due if not self.stopping else ():
            self._spawn()
        return [w.id for w in dead]

    def _gone(self, w: Worker) -> None:
        del self.workers[w.id]
        w.sock.close(linger=0)
        for sock in self.engine:
            sock.send(self.codec.encode(WorkerGone(worker=w.id)))
        self.retired.add(w.metrics)
        if w.stats is not None:
            f = self.retired_front
            f.stale_drops = merge_drops(f.stale_drops + list(w.stats.stale_drops))
            f.undecodable += w.stats.undecodable
            f.handling_errors += w.stats.handling_errors
            f.decode_gaps = merge_gaps(f.decode_gaps + list(w.stats.decode_gaps))
        if not self.stopping:
            log.error(
                "tokenizer worker %d exited with code %s; its requests were aborted; replacing it",
                w.id,
                w.proc.exitcode,
                extra={"worker": w.id},
            )
            self.on_failure(w.cause)

    def stop(self, force: bool = False) -> None:
        self.stopping = True
        stop_children({f"worker-{w.id}": w.proc for w in self.workers.values()}, force)

    # -- what the workers say ---------------------------------------------------------
    def heard(self, msg: WorkerStats) -> None:
        w = self.workers.get(msg.worker)
        if w is not None:
            w.stats, w.heard_at = msg, time.monotonic()

    def up(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.stats is not None and w.proc.is_alive()]

    def send(self, worker: int, msg: Message) -> bool:
        w = self.workers.get(worker)
        if w is None:
            return False
        w.sock.send(self.codec.encode(msg))
        return True

    def broadcast(self, msg: Message) -> None:
        data = self.codec.encode(msg)
        for w in self.workers.values():
            w.sock.send(data)

    # -- what the supervisor needs ---------------------------------------------------------
    def has_in_flight(self) -> bool:
        return any(w.stats.in_flight for w in self.workers.values() if w.stats)

    def engine_failed(self, message: str) -> None:
        """Each worker ends its in-flight requests when it sees the new generation (the next status)."""
        self.generation += 1
        self.failure = message

    def status(self, **kw) -> EngineStatus:
        return EngineStatus(generation=self.generation, failure=self.failure, **kw)

    def front_counts(self) -> FrontCounts:
        """Every worker's TokenizerManager counters, the dead ones' included."""
        stats = [w.stats for w in self.workers.values() if w.stats]
        arrivals = [s.oldest_arrival for s in stats if s.oldest_arrival is not None]
        drops: list[DropCount] = list(self.retired_front.stale_drops)
        for s in stats:
            drops += s.stale_drops
        return FrontCounts(
            merge_drops(drops),
            self.retired_front.undecodable + sum(s.undecodable for s in stats),
            self.retired_front.handling_errors + sum(s.handling_errors for s in stats),
            min(arrivals, default=None),
            merge_gaps(self.retired_front.decode_gaps + [g for s in stats for g in s.decode_gaps]),
        )
