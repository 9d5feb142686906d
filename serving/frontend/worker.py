"""A tokenizer worker process (`--tokenizer-worker-num` > 1): an HTTP server and a
TokenizerManager on the shared port, one of several.

It serves requests exactly as the single-process front end does (same app, same TM),
with three differences: its sockets carry its `worker` id (so the Detokenizer sends its
rids' outputs back here), its engine facts come from the hub (`HubLink`), and
`/metrics` and `/debug/*` are answered by the hub over every worker.  SIGTERM (from the
hub) drains it like the single server: new requests get 503, in-flight ones get
`--shutdown-grace` seconds.  It dies with the hub (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import os
import signal

from serving.args import ServerArgs
from serving.frontend.app import build_app
from serving.frontend.http_server import HTTPServer
from serving.frontend.hub_link import HubLink
from serving.frontend.launch import drain, front_telemetry
from serving.frontend.server_state import ServerState
from serving.frontend.tokenizer_manager import TokenizerManager
from serving.frontend.transport import ZmqTransport
from serving.ipc import Endpoints
from serving.model_files import load_tokenizer, model_name
from serving.process import setup_child

HEARTBEAT = 0.25  # seconds between WorkerStats


async def _serve(args: ServerArgs, endpoints: Endpoints, instance_id: str, worker: int, parent: int) -> None:
    tokenizer, path = load_tokenizer(args.model, args.cache_dir_path)
    name = model_name(args.model, path, args.served_model_name)
    tel, timeline, metrics = front_telemetry(args, name, instance_id, where={"sightline.worker": worker},
                                             role=f"worker-{worker}")
    transport = ZmqTransport(endpoints, args.dp_size, worker=worker)
    link = HubLink(worker, transport.to_hub, metrics, timeline, tel.tail)
    tm = TokenizerManager(args, transport, tokenizer, link, tel, worker=worker)
    link.on_failure = tm.engine_failed
    tm.start()
    state = ServerState(args=args, tm=tm, monitor=link, tel=tel, timeline=timeline, metrics=metrics,
                        model_name=name, endpoints=endpoints, hub=link, loop_lag=tel.loop_lag)
    if metrics is not None:
        metrics.watch(None, lambda: len(tm.rid_to_state))
    state.loop_lag.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def heartbeats() -> None:
        while True:
            link.heartbeat(len(tm.rid_to_state), tm.counts(), tm.finished_total)
            if os.getppid() != parent:
                stop.set()
            await asyncio.sleep(HEARTBEAT)

    async def shutdown_trigger() -> None:
        await stop.wait()
        await drain(state)

    beat = asyncio.create_task(heartbeats())
    try:
        await HTTPServer(build_app(state), args, metrics).serve(shutdown_trigger)
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await state.loop_lag.stop()
        await tm.close()
        tel.shutdown()


def run_worker_process(args: ServerArgs, endpoints: Endpoints, instance_id: str, worker: int) -> None:
    """Entry point of a spawned tokenizer worker."""
    parent = setup_child(f"worker-{worker}", args)
    asyncio.run(_serve(args, endpoints, instance_id, worker, parent))
