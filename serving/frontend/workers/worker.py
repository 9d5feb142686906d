"""A tokenizer worker process (`--tokenizer-worker-num` > 1): an HTTP server and a
TokenizerManager on the shared port, one of several.

It serves requests exactly as the single-process front end does (`stack.FrontEnd`: same
app, same TM), with three differences: its sockets carry its `worker` id (so the
Detokenizer sends its rids' outputs back here), its engine facts come from the hub
(`HubLink`), and `/metrics` and `/debug/*` are answered by the hub over every worker.
SIGTERM (from the hub) drains it like the single server: new requests get 503, in-flight
ones get `--shutdown-grace` seconds.  It dies with the hub (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import os
import signal

from serving.args import ServerArgs
from serving.frontend.http.routes.control import apply_order
from serving.frontend.stack import FrontEnd
from serving.frontend.tokenizer_manager.transport import ZmqTransport
from serving.frontend.workers.hub_link import HubLink
from serving.ipc import Endpoints
from serving.model_files import load_tokenizer, model_name
from serving.process import setup_child

HEARTBEAT = 0.25  # seconds between WorkerStats


async def _serve(args: ServerArgs, endpoints: Endpoints, instance_id: str, worker: int, parent: int) -> None:
    tokenizer, path = load_tokenizer(args.model, args.cache_dir_path)
    name = model_name(args.model, path, args.served_model_name)
    transport = ZmqTransport(endpoints, args.dp_size, worker=worker)
    front = FrontEnd(
        args,
        endpoints,
        name,
        instance_id,
        tokenizer,
        transport,
        lambda tel, timeline, metrics: HubLink(worker, transport.to_hub, metrics, timeline, tel.tail),
        worker=worker,
    )
    link, tm = front.engine, front.tm
    link.on_failure = tm.engine_failed
    link.in_flight = front.state.in_flight_requests  # the hub's `/debug/requests?in_flight=1` asks here
    link.on_control = lambda order: apply_order(front.state, order)  # the hub relays the control POSTs
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def heartbeats() -> None:
        while True:
            link.heartbeat(len(tm.rid_to_state), tm.counts(), tm.finished_total)
            if os.getppid() != parent:
                stop.set()
            await asyncio.sleep(HEARTBEAT)

    beat = asyncio.create_task(heartbeats())
    try:
        await front.serve(stop)
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await front.close()


def run_worker_process(args: ServerArgs, endpoints: Endpoints, instance_id: str, worker: int) -> None:
    """Entry point of a spawned tokenizer worker."""
    parent = setup_child(f"worker-{worker}", args)
    asyncio.run(_serve(args, endpoints, instance_id, worker, parent))
