"""Spawn and stop the engine's child processes (Scheduler, Detokenizer).

A light module on purpose: `run_child` is the spawn target, so a child imports this
file, then only its own process module — never the front end.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

from serving.args import ServerArgs
from serving.ipc import Endpoints

log = logging.getLogger("sightline.supervisor")
CHILD_STOP_TIMEOUT = 5.0
ROLES = ("scheduler", "detokenizer")


def run_child(role: str, *args) -> None:
    """Spawn target of a child process: its module is imported in the child only, so the main
    process never loads torch or the engine."""
    if role == "scheduler":
        # read by the OpenMP runtime when torch loads it, so before the engine is imported
        os.environ["OMP_WAIT_POLICY"] = args[0].thread_wait_policy.upper()
        from serving.engine.scheduler import run_scheduler_process as run
    else:
        from serving.detokenizer.manager import run_detokenizer_process as run
    run(*args)


def spawn(args: ServerArgs, endpoints: Endpoints, instance_id: str) -> dict[str, mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    procs = {role: ctx.Process(target=run_child, args=(role, args, endpoints, instance_id),
                               name=f"sightline-{role}", daemon=True) for role in ROLES}
    for p in procs.values():
        p.start()
    return procs


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
