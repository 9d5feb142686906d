"""`sightline serve`: start the children, serve HTTP, stop everything cleanly.

With `--tokenizer-worker-num N` > 1 the main process is the hub instead
(`serving.frontend.workers.hub`): N worker processes (`workers/worker`) each serve HTTP
with a front end as below.

Order: bind the TokenizerManager's sockets, spawn the Scheduler and the Detokenizer
(`spawn` context, watched by the `EngineSupervisor`), serve HTTP at once (/health says
503 until both report Ready; `serving.frontend.http.server` caps connections and bounds
reads and sends).  On SIGINT/SIGTERM the front end drains (`stack.FrontEnd.drain`), HTTP
stops (connections get a few seconds more, then are closed whatever their clients do),
the children get SIGTERM (SIGKILL after a timeout), the runtime directory goes.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid

from serving import startup_phases
from serving.args import ServerArgs
from serving.frontend.stack import FrontEnd
from serving.frontend.supervision.children import stop_children
from serving.frontend.supervision.crash_dump import CrashDumper
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.frontend.supervision.supervisor import EngineSupervisor, Supervised
from serving.frontend.tenants.keys import KeysFileError
from serving.frontend.tenants.keys import load as load_keys
from serving.frontend.tokenizer_manager.transport import ZmqTransport
from serving.frontend.workers.hub import run_hub
from serving.ipc import Endpoints, runtime_parent
from serving.model_files import ModelLoadError, load_tokenizer, model_name
from serving.process import set_title
from telemetry.logs import setup_logging


async def _serve(args: ServerArgs, endpoints: Endpoints, tokenizer, name: str) -> int:
    instance_id = uuid.uuid4().hex

    def monitor_for(tel, timeline, metrics) -> EngineMonitor:
        return EngineMonitor(
            args.stall_timeout,
            args.watchdog_timeout,
            on_stats=tel.on_stats,
            dp_size=args.dp_size,
            queue_stuck_timeout=args.queue_stuck_timeout,
        )

    front = FrontEnd(args, endpoints, name, instance_id, tokenizer, ZmqTransport(endpoints, args.dp_size), monitor_for)
    monitor, tm, metrics = front.engine, front.tm, front.metrics
    if metrics is not None:
        metrics.watch(lambda: monitor.view(tm.counts()), None)
        metrics.workers_up.set(1)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    crash = CrashDumper.from_args(
        args,
        monitor,
        endpoints.runtime_dir,
        metrics,
        recorder=front.tel.recorder,
        in_flight=lambda: front.state.in_flight_requests(1 << 20),
    )
    supervisor = EngineSupervisor(Supervised(args, monitor, tm, metrics, endpoints, name, crash), instance_id, stop)
    watcher = asyncio.create_task(supervisor.run())
    try:
        await front.serve(stop)
        return supervisor.exit_code
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        stop_children(monitor.procs)
        if crash is not None:
            crash.join()
        await front.close()


def run_server(args: ServerArgs) -> int:
    startup_phases.start("main").begin("args")  # imports: the process's creation → here
    set_title("hub" if args.tokenizer_worker_num > 1 else "main")
    setup_logging("main", args.log_level, args.log_format)
    try:
        load_keys(args.api_keys_file, args.api_key)  # a keys file that fails its checks stops the start here
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        tokenizer, path = load_tokenizer(args.model, args.cache_dir_path)  # converts the model once, here
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    endpoints = Endpoints.create(runtime_parent())
    name = model_name(args.model, path, args.served_model_name)
    try:
        if args.tokenizer_worker_num > 1:
            return asyncio.run(run_hub(args, endpoints, name))
        return asyncio.run(_serve(args, endpoints, tokenizer, name))
    finally:
        endpoints.cleanup()
