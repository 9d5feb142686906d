"""`sightline serve`: start the children, serve HTTP, stop everything cleanly.

With `--tokenizer-worker-num N` > 1 the main process is the hub instead
(`serving.frontend.hub`): N worker processes (`serving.frontend.worker`) each serve HTTP
with a TokenizerManager as below.

Order: bind the TokenizerManager's sockets, spawn the Scheduler and the Detokenizer
(`spawn` context, watched by the `EngineSupervisor`), serve HTTP at once (/health says
503 until both report Ready; `serving.frontend.http_server` caps connections and bounds reads and
sends).  On SIGINT/SIGTERM: new requests get 503, in-flight ones may finish for
`--shutdown-grace` seconds, the rest end with an explicit error, HTTP stops (connections
get a few seconds more, then are closed whatever their clients do), the children get
SIGTERM (SIGKILL after a timeout), the runtime directory goes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import uuid

from serving.args import ServerArgs
from serving.model_files import ModelLoadError, load_tokenizer, model_name
from serving.frontend.app import build_app
from serving.frontend.http_server import HTTPServer
from serving.ipc import Endpoints, runtime_parent
from serving.process import set_title
from serving.frontend.server_state import ServerState
from serving.frontend.children import engine_roles, stop_children
from serving.frontend.crash_dump import CrashDumper
from serving.frontend.engine_monitor import EngineMonitor
from serving.frontend.supervisor import EngineSupervisor, Supervised
from serving.frontend.tokenizer_manager import TokenizerManager
from serving.frontend.transport import ZmqTransport
from telemetry.logs import setup_logging
from telemetry.loop_lag import LoopLagMonitor
from telemetry.buckets import parse_bucket_overrides
from telemetry.flight_recorder import FlightRecorder
from telemetry.genai_metrics import GenAIMetrics
from telemetry.metrics import Metrics
from telemetry.request_telemetry import RequestTelemetry
from telemetry.tail_sampling import slo_policy
from telemetry.timeline import Timeline
from telemetry.tracing import Tracing

__version__ = "0.1.0"
log = logging.getLogger("sightline")


def front_telemetry(args: ServerArgs, name: str, instance_id: str, where: dict[str, int] | None = None,
                    role: str = "main") -> tuple[RequestTelemetry, Timeline, Metrics | None]:
    """A TokenizerManager's telemetry: tracer, metrics registry, timeline, event-loop monitor
    (`tel.loop_lag`, observed as `sightline_event_loop_lag_seconds{role}`), one per tokenizer worker."""
    timeline = Timeline(args.request_timeline_size)
    sinks = [timeline.add_span]  # and the tail sampler's, when it is on
    tracing = Tracing.from_args("main", args, instance_id, sink=lambda rec: [f(rec) for f in sinks], where=where)
    metrics = Metrics(name, parse_bucket_overrides(args.histogram_buckets), version=__version__,
                      roles=tuple(engine_roles(args.dp_size))) \
        if args.enable_metrics else None
    loop_lag = LoopLagMonitor(metrics.loop_lag.labels(role).observe if metrics is not None else None)
    tel = RequestTelemetry(tracing, metrics, timeline, name, args.log_requests, loop_lag)
    tel.genai = GenAIMetrics.from_args(args, name, instance_id, where=where)  # None unless exported
    tel.tail = tracing.tail_sampler(args.tail_sampling_buffer_traces, metrics.count_tail if metrics else None)
    tel.tail_policy = slo_policy(args.tail_sampling_ttft_ms, args.tail_sampling_tpot_ms)
    if tel.tail is not None:
        sinks.append(tel.tail.add)
    if args.dump_requests or args.crash_dump_dir:  # the flight recorder (with only a crash dir: its ring alone)
        tel.recorder = FlightRecorder(args.dump_requests, name, content=args.dump_content,
                                      max_file_mb=args.dump_requests_max_file_mb,
                                      max_files=args.dump_requests_max_files, ring=args.crash_dump_requests,
                                      prefix="requests-" if role == "main" else f"requests-w{role.rsplit('-', 1)[-1]}-",
                                      metrics=metrics)
    return tel, timeline, metrics


async def drain(state: ServerState) -> None:
    """Refuse new work, let in-flight requests finish for the grace period, end the rest explicitly."""
    tm, grace = state.tm, state.args.shutdown_grace
    state.monitor.shutting_down = True
    log.info("shutting down: %d requests in flight, up to %.0f s to finish", len(tm.rid_to_state), grace)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while tm.rid_to_state and loop.time() < deadline and all(p.is_alive() for p in state.monitor.procs.values()):
        await asyncio.sleep(0.05)
    if tm.rid_to_state:
        log.warning("shutdown grace over: aborting %d requests", len(tm.rid_to_state))
        tm.abort_all("shutdown", "the server is shutting down")


async def _serve(args: ServerArgs, endpoints: Endpoints, tokenizer, name: str) -> int:
    instance_id = uuid.uuid4().hex
    tel, timeline, metrics = front_telemetry(args, name, instance_id)
    monitor = EngineMonitor(args.stall_timeout, args.watchdog_timeout, on_stats=tel.on_stats, dp_size=args.dp_size)
    tm = TokenizerManager(args, ZmqTransport(endpoints, args.dp_size), tokenizer, monitor, tel)
    tm.start()
    state = ServerState(args=args, tm=tm, monitor=monitor, tel=tel, timeline=timeline, metrics=metrics,
                        model_name=name, endpoints=endpoints, loop_lag=tel.loop_lag)
    if metrics is not None:
        metrics.watch(lambda: monitor.view(tm.counts()), lambda: len(tm.rid_to_state))
        metrics.workers_up.set(1)
    state.loop_lag.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def shutdown_trigger() -> None:
        await stop.wait()
        await drain(state)

    crash = CrashDumper.from_args(args, monitor, endpoints.runtime_dir, metrics, recorder=tel.recorder,
                                  in_flight=lambda: state.in_flight_requests(1 << 20))
    supervisor = EngineSupervisor(Supervised(args, monitor, tm, metrics, endpoints, name, crash), instance_id, stop)
    watcher = asyncio.create_task(supervisor.run())
    try:
        await HTTPServer(build_app(state), args, metrics).serve(shutdown_trigger)
        return supervisor.exit_code
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        stop_children(monitor.procs)
        if crash is not None:
            crash.join()
        await state.loop_lag.stop()
        await tm.close()
        tel.shutdown()


def run_server(args: ServerArgs) -> int:
    set_title("hub" if args.tokenizer_worker_num > 1 else "main")
    setup_logging("main", args.log_level, args.log_format)
    try:
        tokenizer, path = load_tokenizer(args.model, args.cache_dir_path)  # converts the model once, here
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    endpoints = Endpoints.create(runtime_parent())
    name = model_name(args.model, path, args.served_model_name)
    try:
        if args.tokenizer_worker_num > 1:
            from serving.frontend.hub import run_hub

            return asyncio.run(run_hub(args, endpoints, name))
        return asyncio.run(_serve(args, endpoints, tokenizer, name))
    finally:
        endpoints.cleanup()
