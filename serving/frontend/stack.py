"""One front end, assembled once: telemetry, a TokenizerManager, its HTTP app and server.

A single-process server runs one (`launch`); with `--tokenizer-worker-num` N > 1 each of
the N worker processes runs one (`workers/worker`).  They differ only in where engine
facts come from (`make_engine`: the `EngineMonitor`, or the worker's `HubLink`) and in the
`worker` id stamped on what they send.  `serve` answers HTTP until `stop` is set, then
drains: new requests get 503, in-flight ones may finish for `--shutdown-grace` seconds,
the rest end with an explicit error.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Callable

from protocol.reasons import AbortReason
from serving import __version__
from serving.args import ServerArgs
from serving.frontend.engine_state import EngineState
from serving.frontend.http.app import build_app
from serving.frontend.http.routes.responses_store import ResponseStore
from serving.frontend.http.server import HTTPServer
from serving.frontend.http.state import ServerState
from serving.frontend.tenants.gate import HubGate, LocalGate
from serving.frontend.tenants.store import KeyStore
from serving.frontend.tokenizer_manager.manager import TokenizerManager
from serving.frontend.tokenizer_manager.transport import EngineTransport
from serving.ipc import Endpoints, engine_roles
from serving.process import freeze_heap
from telemetry.buckets import parse_bucket_overrides
from telemetry.downstream_gaps import DownstreamGaps
from telemetry.flight_recorder import FlightRecorder
from telemetry.genai_metrics import GenAIMetrics
from telemetry.loop_lag import LoopLagMonitor
from telemetry.metrics import Metrics
from telemetry.request_telemetry import RequestTelemetry
from telemetry.tail_sampling import slo_policy
from telemetry.timeline import Timeline
from telemetry.tracing import Tracing

log = logging.getLogger("sightline")
EngineFactory = Callable[[RequestTelemetry, Timeline, Metrics | None], EngineState]


def front_telemetry(
    args: ServerArgs, name: str, instance_id: str, where: dict[str, int] | None = None, role: str = "main"
) -> tuple[RequestTelemetry, Timeline, Metrics | None]:
    """A TokenizerManager's telemetry: tracer, metrics registry, timeline, event-loop monitor
    (`tel.loop_lag`, observed as `sightline_event_loop_lag_seconds{role}`), one per tokenizer worker."""
    timeline = Timeline(args.request_timeline_size)
    sinks = [timeline.add_span]  # and the tail sampler's, when it is on
    tracing = Tracing.from_args("main", args, instance_id, sink=lambda rec: [f(rec) for f in sinks], where=where)
    metrics = (
        Metrics(
            name,
            parse_bucket_overrides(args.histogram_buckets),
            version=__version__,
            roles=tuple(engine_roles(args.dp_size)),
        )
        if args.enable_metrics
        else None
    )
    loop_lag = LoopLagMonitor(None)
    tel = RequestTelemetry(tracing, metrics, timeline, name, args.log_requests, loop_lag)
    if metrics is not None:  # through `observe`, as every histogram of the process (the OTLP catalogue's mirror)
        loop_lag.observe = lambda lag: tel.observe(metrics.loop_lag, lag, None, role)
    tel.gaps = (
        DownstreamGaps(args.decode_gap_factor, args.decode_gap_floor, wall=tracing.wall)
        if args.step_timeline_steps
        else None
    )
    tel.genai = GenAIMetrics.from_args(args, name, instance_id, where=where, metrics=metrics)  # None unless exported
    tel.otlp_mirror = tel.genai.mirror if tel.genai is not None else None
    tel.tail = tracing.tail_sampler(args.tail_sampling_buffer_traces, metrics.count_tail if metrics else None)
    tel.tail_policy = slo_policy(args.tail_sampling_ttft_ms, args.tail_sampling_tpot_ms)
    if tel.tail is not None:
        sinks.append(tel.tail.add)
    if args.dump_requests or args.crash_dump_dir:  # the flight recorder (with only a crash dir: its ring alone)
        tel.recorder = FlightRecorder(
            args.dump_requests,
            name,
            content=args.dump_content,
            max_file_mb=args.dump_requests_max_file_mb,
            max_files=args.dump_requests_max_files,
            ring=args.crash_dump_requests,
            prefix="requests-" if role == "main" else f"requests-w{role.rsplit('-', 1)[-1]}-",
            metrics=metrics,
        )
    return tel, timeline, metrics


class FrontEnd:
    """Telemetry, a TokenizerManager over `transport`, and the state its HTTP handlers share."""

    def __init__(
        self,
        args: ServerArgs,
        endpoints: Endpoints,
        name: str,
        instance_id: str,
        tokenizer: Any,
        transport: EngineTransport,
        make_engine: EngineFactory,
        worker: int | None = None,
    ) -> None:
        where = {"sightline.worker": worker} if worker is not None else None
        self.tel, timeline, self.metrics = front_telemetry(
            args, name, instance_id, where, "main" if worker is None else f"worker-{worker}"
        )
        self.engine = make_engine(self.tel, timeline, self.metrics)
        self.keys = KeyStore(args.api_keys_file, args.api_key)  # checked before the children start (launch)
        self.tel.tenants_from(self.keys.tenants(), args.max_tenant_labels)
        self.keys.on_reload = self._keys_reloaded
        gate = LocalGate(self.keys.policy) if worker is None else HubGate(self.engine, self.keys.policy)
        self.tm = TokenizerManager(
            args, transport, tokenizer, self.engine, self.tel, worker=worker or 0, tenants=gate, policy=self.keys.policy
        )
        self.tm.start()
        single = worker is None  # this process supervises the engine; a worker's HubLink asks the hub instead
        self.state = ServerState(
            args=args,
            tm=self.tm,
            engine=self.engine,
            tel=self.tel,
            timeline=timeline,
            metrics=self.metrics,
            model_name=name,
            endpoints=endpoints,
            loop_lag=self.tel.loop_lag,
            monitor=self.engine if single else None,
            hub=None if single else self.engine,
            keys=self.keys,
            responses=ResponseStore(args.responses_store_size, self.metrics),
        )
        if self.metrics is not None:  # the engine's numbers are observed where it is supervised (launch, hub)
            self.metrics.watch(None, lambda: len(self.tm.rid_to_state))

    def _keys_reloaded(self, result: str) -> None:
        if result == "ok":
            self.tel.tenants_from(self.keys.tenants(), self.state.args.max_tenant_labels)
        if self.metrics is not None:
            self.metrics.key_reloads.labels(result).inc()

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer HTTP until `stop` is set, then drain (`close` afterwards, once the engine is stopped).
        The keys file is watched meanwhile, and reloaded on SIGHUP."""
        freeze_heap()
        self.state.loop_lag.start()
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.keys.reload)
        watch = asyncio.create_task(self.keys.watch())

        async def shutdown_trigger() -> None:
            await stop.wait()
            await self.drain()

        try:
            await HTTPServer(build_app(self.state), self.state.args, self.metrics).serve(shutdown_trigger)
        finally:
            watch.cancel()

    async def close(self) -> None:
        await self.state.loop_lag.stop()
        await self.tm.close()
        self.tel.shutdown()

    async def drain(self) -> None:
        """Refuse new work, let in-flight requests finish for the grace period, end the rest explicitly."""
        tm, grace = self.tm, self.state.args.shutdown_grace
        self.engine.begin_shutdown()
        log.info("shutting down: %d requests in flight, up to %.0f s to finish", len(tm.rid_to_state), grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while tm.rid_to_state and loop.time() < deadline and all(p.is_alive() for p in self.engine.procs.values()):
            await asyncio.sleep(0.05)
        if tm.rid_to_state:
            log.warning("shutdown grace over: aborting %d requests", len(tm.rid_to_state))
            tm.abort_all(AbortReason.SHUTDOWN, "the server is shutting down")
