"""Spawn and stop the child processes: the engine's (Scheduler ranks, Detokenizer) and the
tokenizer workers.

A light module on purpose: `run_child` is the spawn target, so a child imports this
file, then only its own process module — never the front end.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

from serving.args import WAIT_POLICIES, ServerArgs
from serving.ipc import Endpoints, scheduler_role
from serving.process import set_title

log = logging.getLogger("sightline.supervisor")
CHILD_STOP_TIMEOUT = 5.0


def run_child(kind: str, role: str, *args) -> None:
    """Spawn target of a child process: its module is imported in the child only, so the main
    process never loads torch or the engine. Titled first, so ps names it while torch loads."""
    set_title(role)
    if kind == "scheduler":
        # read by the OpenMP runtime when torch loads it, so before the engine is imported
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            os.environ.pop(name, None)
        os.environ.update(WAIT_POLICIES[args[0].thread_wait_policy])
        from serving.engine.scheduler import run_scheduler_process as run
    elif kind == "worker":
        from serving.frontend.workers.worker import run_worker_process as run
    else:
        from serving.detokenizer.manager import run_detokenizer_process as run
    run(*args)


def _start(name: str, kind: str, *args) -> mp.process.BaseProcess:
    p = mp.get_context("spawn").Process(
        target=run_child, args=(kind, name, *args), name=f"sightline-{name}", daemon=True
    )
    p.start()
    return p


def spawn(args: ServerArgs, endpoints: Endpoints, instance_id: str) -> dict[str, mp.process.BaseProcess]:
    """The engine: every Scheduler rank and the Detokenizer, by role."""
    procs = {
        scheduler_role(r, args.dp_size): _start(
            scheduler_role(r, args.dp_size), "scheduler", args, endpoints, instance_id, r
        )
        for r in range(args.dp_size)
    }
    procs["detokenizer"] = _start("detokenizer", "detokenizer", args, endpoints, instance_id)
    return procs


def spawn_worker(args: ServerArgs, endpoints: Endpoints, instance_id: str, worker: int) -> mp.process.BaseProcess:
    """One tokenizer worker (HTTP server + TokenizerManager) with id `worker`, never reused."""
    return _start(f"worker-{worker}", "worker", args, endpoints, instance_id, worker)


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
