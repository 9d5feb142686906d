"""The main process with several tokenizer workers: supervisor and telemetry owner.

It serves no HTTP itself.  It spawns the engine (every Scheduler rank and the
Detokenizer, watched by the same `EngineSupervisor` as with one worker) and the N
workers (`WorkerFleet`), owns the control socket every child reports to (Ready, stats,
heartbeats), and relays to each worker an `EngineStatus` every 100 ms.  It answers what
must see every worker at once:

* `/metrics`: the engine's numbers and its own (from its registry) plus every worker's
  registry, merged at scrape time (`telemetry.registry_merge`): one scrape on the port,
  whichever worker takes it, returns complete numbers, exemplars kept;
* `/debug/requests/{rid}`: asks every worker for the rid's entry and adds the engine's
  spans, which reach the hub in the children's stats;
* `/debug/requests` (recent, or `in_flight=1`): every worker's list, merged;
* `/debug/state`: the engine's state, every worker's, and the dispatch counters;
* the control POSTs (`control_relay.py`): applied by every worker and rank, confirmed by all;
* the tenants' limits (`tenants/limits.TenantLimiter`): a worker asks before it admits a request
  of a limited tenant and says when it ended, so a limit holds over every worker.

SIGTERM/SIGINT: every worker drains (`--shutdown-grace`), then the engine stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import uuid

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from protocol.io_struct import (
    BarrierReq,
    FlushCacheReqOutput,
    HubQuery,
    HubReply,
    MetricFamily,
    Snapshot,
    SnapshotReq,
    StepTimelineOutput,
    WorkerStats,
)
from serving import __version__
from serving.args import ServerArgs
from serving.frontend.supervision.children import stop_children
from serving.frontend.supervision.crash_dump import CrashDumper
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.frontend.supervision.supervisor import EngineSupervisor, Supervised
from serving.frontend.tenants.limits import TenantLimiter
from serving.frontend.tenants.store import KeyStore
from serving.frontend.workers.control_relay import ControlRelay
from serving.frontend.workers.fleet import WorkerFleet
from serving.ipc import Codec, Endpoints, engine_roles, make_socket
from telemetry.buckets import parse_bucket_overrides
from telemetry.clock import now_ns
from telemetry.genai_metrics import GenAIMetrics
from telemetry.metrics import Metrics
from telemetry.registry_merge import merge, registry_of, snapshot
from telemetry.timeline import Timeline
from telemetry.tracing import Tracing

log = logging.getLogger("sightline.hub")
STATUS_INTERVAL = 0.1  # seconds between EngineStatus broadcasts (and worker checks)
GATHER_TIMEOUT = 2.0  # seconds the workers have to answer a SnapshotReq (a silent one: its last metrics)
WORKER_STOP_EXTRA = 10.0  # past --shutdown-grace, seconds a draining worker gets before it is killed


class Hub:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, name: str) -> None:
        self.args, self.endpoints, self.name = args, endpoints, name
        self.instance_id = uuid.uuid4().hex
        self.timeline = Timeline(args.request_timeline_size)  # the engine's spans, for /debug/requests
        # the engine's spans of requests tail sampling recorded; the workers decide, the hub exports
        self.tracing = Tracing.from_args("hub", args, self.instance_id)
        self.metrics = (
            Metrics(
                name,
                parse_bucket_overrides(args.histogram_buckets),
                version=__version__,
                hub=True,
                roles=tuple(engine_roles(args.dp_size)),
            )
            if args.enable_metrics
            else None
        )
        self.tail = self.tracing.tail_sampler(
            args.tail_sampling_buffer_traces, self.metrics.count_tail if self.metrics else None
        )
        self.monitor = EngineMonitor(
            args.stall_timeout,
            args.watchdog_timeout,
            on_stats=self._on_stats,
            dp_size=args.dp_size,
            queue_stuck_timeout=args.queue_stuck_timeout,
        )
        self.ctx = zmq.asyncio.Context()
        self.codec = Codec("tokenizer_manager")  # the control socket's: as the single TM's, counted as the front's
        self.control = make_socket(self.ctx, zmq.PULL, endpoints.control, do_bind=True)
        self.fleet = WorkerFleet(args, endpoints, self.instance_id, self.ctx, self.codec, self._worker_failed)
        self.gathering: dict[str, tuple[set[int], dict[int, Snapshot], asyncio.Future]] = {}
        self.controls = ControlRelay(self.monitor, self.fleet, self.gather, self.send_status)
        self.answering: set[asyncio.Task] = set()
        self.keys = KeyStore(args.api_keys_file, args.api_key)  # the tenants' limits, reloaded as the workers'
        self.limiter = TenantLimiter(self.keys.policy)  # one count per tenant over every worker
        if self.metrics is not None:
            self.metrics.watch(lambda: self.monitor.view(self._front_counts()), None)
            self.metrics.workers_up.set_function(lambda: len(self.fleet.up()))
        # --otel-metrics-catalogue: the engine's numbers (held here) over OTLP beside each worker's own
        self.otlp = (
            GenAIMetrics.from_args(args, name, self.instance_id, metrics=self.metrics, role="hub")
            if args.otel_metrics_catalogue and self.metrics is not None
            else None
        )

    # -- the supervisor's Front --------------------------------------------------------
    def has_in_flight(self) -> bool:
        return self.fleet.has_in_flight()

    def engine_failed(self, message: str) -> None:
        """Forget the dead engine; the workers end their in-flight requests on the next status."""
        self.fleet.engine_failed(message)
        self.monitor.reset()

    def _on_stats(self, msg, recv) -> None:
        for span in msg.spans:
            self.timeline.add_span(span)
            if self.tail is not None:
                self.tail.add(span)

    def _tail_decisions(self, msg: WorkerStats) -> None:
        if self.tail is not None:
            for trace_id in msg.tail_kept:
                self.tail.decide(trace_id, "kept", counted=False)
            for trace_id in msg.tail_dropped:
                self.tail.decide(trace_id, None, counted=False)

    def _worker_failed(self, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.worker_failures.labels(cause).inc()

    def _front_counts(self):
        counts = self.fleet.front_counts()
        counts.undecodable += self.codec.undecodable
        return counts

    # -- loops ------------------------------------------------------------------------
    async def receive(self) -> None:
        while True:
            msg = self.codec.decode(await self.control.recv())
            try:
                if isinstance(msg, WorkerStats):
                    self.fleet.heard(msg)
                    self._tail_decisions(msg)
                elif isinstance(msg, Snapshot):
                    self._snapshot(msg)
                elif isinstance(msg, HubQuery) and msg.kind.startswith("tenant_"):
                    self._tenant_query(msg)  # at once, in order: an acquire's answer must see every release
                elif isinstance(msg, HubQuery):
                    task = asyncio.create_task(self.answer(msg))
                    self.answering.add(task)  # held until done: the loop keeps only weak references
                    task.add_done_callback(self.answering.discard)
                elif isinstance(msg, (FlushCacheReqOutput, StepTimelineOutput, BarrierReq)):  # to the worker that asked
                    self.fleet.send(msg.worker, msg)
                elif msg is not None and not self.monitor.handle(msg):
                    self.codec.undecodable += 1
            except Exception:
                log.exception("failed to handle a %s", type(msg).__name__)

    async def relay(self) -> None:
        """Replace dead workers; tell every worker what the engine is up to."""
        while True:
            for worker in self.fleet.reap():
                self.limiter.drop_worker(worker)  # its requests died with it
            self.monitor.watch_workers({f"worker-{w.id}": w.proc for w in self.fleet.workers.values()})
            self.send_status()
            await asyncio.sleep(STATUS_INTERVAL)

    def send_status(self) -> None:
        """Every worker's `EngineStatus` now (each heartbeat, and ahead of a control order)."""
        ok, reason = self.monitor.health(self.fleet.front_counts().oldest_arrival)
        ready = (
            sorted(self.monitor.ready.values(), key=lambda r: (r.role == "detokenizer", r.dp_rank))
            if self.monitor.all_ready.is_set()
            else []
        )
        self.fleet.broadcast(
            self.fleet.status(
                ready=ready,
                unavailable=None if ok else reason,
                throughput=self.monitor.throughput.rate(now_ns()),
                last_token_at=self.monitor.last_token_at,
                down_at=self.monitor.down_at,
                paused=self.monitor.paused,
            )
        )

    def _tenant_query(self, q: HubQuery) -> None:
        """A worker's `tenant_acquire` (answered: 200, or 429 with the refusal) or `tenant_release`."""
        arg = json.loads(q.arg)
        if q.kind == "tenant_release":
            self.limiter.release((q.worker, arg["rid"]), arg["output_tokens"])
            return
        refusal = self.limiter.acquire(arg["tenant"], (q.worker, arg["rid"]), arg["prompt_tokens"])
        body = json.dumps(dataclasses.asdict(refusal)).encode() if refusal else b""
        self.fleet.send(q.worker, HubReply(id=q.id, status=429 if refusal else 200, body=body))

    def reload_keys(self) -> None:
        """SIGHUP: reload here and in every worker (each also watches the file)."""
        self.keys.reload()
        for w in self.fleet.workers.values():
            if w.proc.is_alive() and w.proc.pid:
                os.kill(w.proc.pid, signal.SIGHUP)

    # -- answers over every worker ---------------------------------------------------------
    def _snapshot(self, snap: Snapshot) -> None:
        if not snap.id:  # a worker's own push: its latest metrics, kept should it die
            if snap.worker in self.fleet.workers:
                self.fleet.workers[snap.worker].metrics = snap.families
            return
        pending = self.gathering.get(snap.id)
        if pending is None:
            return
        expected, got, done = pending
        got[snap.worker] = snap
        if expected <= got.keys() and not done.done():
            done.set_result(None)

    async def gather(self, kind: str, arg: str = "") -> dict[int, Snapshot]:
        """Every worker's answer to a SnapshotReq (those that answered within GATHER_TIMEOUT)."""
        sid = uuid.uuid4().hex
        expected = {w.id for w in self.fleet.up()}
        got: dict[int, Snapshot] = {}
        done = asyncio.get_running_loop().create_future()
        self.gathering[sid] = (expected, got, done)
        try:
            self.fleet.broadcast(SnapshotReq(id=sid, kind=kind, arg=arg))
            if expected:
                await asyncio.wait_for(done, GATHER_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning(
                "workers %s did not answer a %s snapshot in %.0f s", sorted(expected - got.keys()), kind, GATHER_TIMEOUT
            )
        finally:
            del self.gathering[sid]
        return got

    async def answer(self, q: HubQuery) -> None:
        try:
            reply = await {
                "metrics": self._metrics,
                "debug_state": self._debug_state,
                "request": self._request,
                "requests": self._requests,
                "control": self.controls.answer,
            }[q.kind](q.arg)
        except Exception:
            log.exception("failed to answer a %s query", q.kind)
            reply = _error(500, "internal error in the hub", "internal_error")
        reply.id = q.id
        self.fleet.send(q.worker, reply)

    async def _metrics(self, fmt: str) -> HubReply:
        if self.metrics is None:
            return _error(404, "metrics are disabled (--no-enable-metrics)", "not_found_error")
        for wid, snap in (await self.gather("metrics")).items():
            if wid in self.fleet.workers:
                self.fleet.workers[wid].metrics = snap.families
        workers: dict[int, list[MetricFamily]] = {w.id: w.metrics for w in self.fleet.workers.values()}
        reg = registry_of(merge(snapshot(self.metrics.registry), workers, self.fleet.retired))
        return HubReply(id="", body=(openmetrics_latest if fmt == "openmetrics" else generate_latest)(reg))

    async def _debug_state(self, _: str) -> HubReply:
        front = self._front_counts()
        workers = {
            str(w.id): {"pid": w.proc.pid, "up": w.stats is not None, "in_flight": w.stats.in_flight if w.stats else 0}
            for w in self.fleet.workers.values()
        }
        state = {
            "in_flight": sum(w["in_flight"] for w in workers.values()),
            **self.monitor.debug_state(front),
            "workers": workers,
            "engine_generation": self.fleet.generation,
            "runtime_dir": self.endpoints.runtime_dir,
            "model": self.name,
            "tenants": self.limiter.snapshot(),
        }
        return HubReply(id="", body=json.dumps(state).encode())

    async def _request(self, rid: str) -> HubReply:
        for snap in (await self.gather("request", rid)).values():
            if snap.entry:
                entry = json.loads(snap.entry)
                seen = {s["span_id"] for s in entry["spans"]}
                entry["spans"] += [
                    msgspec.to_builtins(s) for s in self.timeline.spans_of(entry["trace_id"]) if s.span_id not in seen
                ]
                entry["spans"].sort(key=lambda s: (s["start_ns"], s["end_ns"]))
                return HubReply(id="", body=json.dumps(entry).encode())
        return _error(404, f"no finished request {rid!r} in the timeline buffer", "not_found_error", "rid")

    async def _requests(self, arg: str) -> HubReply:
        """Every worker's recent (or in-flight) requests: newest finished first (oldest in flight first)."""
        q = json.loads(arg)
        found = [r for snap in (await self.gather("requests", arg)).values() for r in json.loads(snap.entry or b"[]")]
        if q["in_flight"]:
            found.sort(key=lambda r: -r["age_ms"])
        else:
            for r in found:  # the engine's spans of the request are the hub's
                r["spans"] += len(self.timeline.spans_of(r["trace_id"]))
            found.sort(key=lambda r: -r.get("finished_at", 0.0))
        return HubReply(id="", body=json.dumps({"requests": found[: q["limit"]]}).encode())

    async def in_flight(self) -> list[dict]:
        """Every worker's requests in flight (for a crash dump)."""
        arg = json.dumps({"limit": 1 << 20, "in_flight": True})
        return [r for snap in (await self.gather("requests", arg)).values() for r in json.loads(snap.entry or b"[]")]

    # -- shutdown -------------------------------------------------------------------------
    async def stop_workers(self) -> None:
        """SIGTERM every worker (each drains), wait for them, kill what is left."""
        self.monitor.begin_shutdown()
        self.fleet.stopping = True
        procs = [w.proc for w in self.fleet.workers.values()]
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = asyncio.get_running_loop().time() + self.args.shutdown_grace + WORKER_STOP_EXTRA
        while any(p.is_alive() for p in procs) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self.fleet.stop(force=True)


def _error(status: int, message: str, kind: str, param: str | None = None) -> HubReply:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return HubReply(id="", status=status, body=json.dumps(body).encode())


async def run_hub(args: ServerArgs, endpoints: Endpoints, name: str) -> int:
    hub = Hub(args, endpoints, name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, hub.reload_keys)
    crash = CrashDumper.from_args(
        args,
        hub.monitor,
        endpoints.runtime_dir,
        hub.metrics,
        role="hub",
        in_flight_async=hub.in_flight,
        records_dir=args.dump_requests,
    )
    supervisor = EngineSupervisor(
        Supervised(args, hub.monitor, hub, hub.metrics, endpoints, name, crash), hub.instance_id, stop
    )
    hub.fleet.start(args.tokenizer_worker_num)
    log.info(
        "hub: %d tokenizer workers, %d Scheduler ranks, serving on http://%s:%d",
        args.tokenizer_worker_num,
        args.dp_size,
        args.host,
        args.port,
    )
    tasks = [asyncio.create_task(t) for t in (hub.receive(), hub.relay(), supervisor.run(), hub.keys.watch())]
    try:
        await stop.wait()
        log.info("shutting down: the workers drain, then the engine stops")
        await hub.stop_workers()
        return supervisor.exit_code
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        hub.fleet.stop(force=True)
        stop_children(hub.monitor.procs)
        if crash is not None:
            crash.join()
        if hub.tail is not None:
            hub.tail.shutdown()  # the kept traces' engine spans still queued
        hub.tracing.shutdown()
        if hub.otlp is not None:
            hub.otlp.shutdown()
        hub.ctx.destroy(linger=0)
