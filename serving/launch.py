"""`sightline serve`: start the children, serve HTTP, stop everything cleanly.

Order: bind the TokenizerManager's sockets, spawn the Scheduler and the Detokenizer
(`spawn` context: no inherited locks or CUDA/torch state), serve HTTP at once (/health
says 503 until both report Ready), and on SIGINT/SIGTERM: refuse new work, end every
in-flight request with an explicit error, stop HTTP, SIGTERM the children (SIGKILL after
a timeout) and remove the runtime directory.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
import sys
import uuid

from hypercorn.asyncio import serve
from hypercorn.config import Config

from serving.args import ServerArgs
from serving.detokenizer import run_detokenizer_process
from serving.engine.loader import ModelLoadError, load_tokenizer, model_name
from serving.http_api import build_app
from serving.ipc import Endpoints, runtime_parent
from serving.scheduler import run_scheduler_process
from serving.server_state import ServerState
from serving.tokenizer_manager import TokenizerManager
from telemetry.logs import setup_logging
from telemetry.metrics import Metrics, parse_bucket_overrides
from telemetry.request_telemetry import RequestTelemetry
from telemetry.timeline import Timeline
from telemetry.tracing import Tracing

__version__ = "0.1.0"

log = logging.getLogger("sightline")
CHILD_STOP_TIMEOUT = 5.0


def _spawn(args: ServerArgs, endpoints: Endpoints, instance_id: str) -> dict[str, mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    procs = {
        "scheduler": ctx.Process(target=run_scheduler_process, args=(args, endpoints, instance_id),
                                 name="sightline-scheduler", daemon=True),
        "detokenizer": ctx.Process(target=run_detokenizer_process, args=(args, endpoints, instance_id),
                                   name="sightline-detokenizer", daemon=True),
    }
    for p in procs.values():
        p.start()
    return procs


def stop_children(procs: dict[str, mp.process.BaseProcess]) -> None:
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    for role, p in procs.items():
        p.join(CHILD_STOP_TIMEOUT)
        if p.is_alive():
            log.warning("%s did not stop in %.0f s; killing it", role, CHILD_STOP_TIMEOUT)
            p.kill()
            p.join()


async def _watch_startup(state: ServerState, stop: asyncio.Event) -> int:
    """0 once both children are ready; 1 (and stop) if one dies or the timeout passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.args.startup_timeout
    while not state.tm.all_ready.is_set():
        dead = [role for role, p in state.procs.items() if not p.is_alive()]
        if dead or loop.time() > deadline:
            why = f"{dead[0]} exited during startup" if dead else "startup timed out"
            log.error("%s; shutting down", why)
            stop.set()
            return 1
        await asyncio.sleep(0.1)
    log.info("ready: serving %s on http://%s:%d", state.model_name, state.args.host, state.args.port)
    return 0


def _telemetry(args: ServerArgs, name: str, instance_id: str) -> tuple[RequestTelemetry, Timeline, Metrics | None]:
    timeline = Timeline(args.request_timeline_size)
    tracing = Tracing.from_args("main", args, instance_id, sink=timeline.add_span)
    metrics = Metrics(name, parse_bucket_overrides(args.histogram_buckets), version=__version__) \
        if args.enable_metrics else None
    return RequestTelemetry(tracing, metrics, timeline, name, args.log_requests), timeline, metrics


async def _serve(args: ServerArgs, endpoints: Endpoints, tokenizer, name: str) -> int:
    instance_id = uuid.uuid4().hex
    tel, timeline, metrics = _telemetry(args, name, instance_id)
    tm = TokenizerManager(args, endpoints, tokenizer, name, tel)
    tm.start()
    state = ServerState(args=args, tm=tm, tel=tel, timeline=timeline, metrics=metrics, model_name=name,
                        endpoints=endpoints)
    if metrics is not None:
        metrics.watch(state.engine_snapshot, lambda: len(tm.rid_to_state))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def shutdown_trigger() -> None:
        await stop.wait()
        log.info("shutting down: ending %d in-flight requests", len(tm.rid_to_state))
        state.shutting_down = True
        tm.abort_all("shutdown", "the server is shutting down")

    watcher: asyncio.Task | None = None
    try:
        state.procs = _spawn(args, endpoints, instance_id)
        config = Config()
        config.bind = [f"{args.host}:{args.port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")  # our handlers and format, once
        config.graceful_timeout = 5.0
        watcher = asyncio.create_task(_watch_startup(state, stop))
        await serve(build_app(state), config, shutdown_trigger=shutdown_trigger)
        return watcher.result() if watcher.done() else 0
    finally:
        if watcher is not None:
            watcher.cancel()
        stop_children(state.procs)
        await tm.close()
        tel.tracing.shutdown()


def run_server(args: ServerArgs) -> int:
    setup_logging("main", args.log_level, args.log_format)
    try:
        tokenizer, path = load_tokenizer(args.model, args.cache_dir_path)  # converts the model once, here
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    endpoints = Endpoints.create(runtime_parent())
    try:
        return asyncio.run(_serve(args, endpoints, tokenizer, model_name(args.model, path, args.served_model_name)))
    finally:
        endpoints.cleanup()
