"""Decode step time with and without a CPU hog beside the engine (see docs/engine.md).

.venv/bin/python -m bench.oversubscription [--hog] [--model smollm2-135m]
OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.oversubscription --hog
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics

from bench.common import make_prompts
from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.engine.loader import load_model
from serving.engine.scheduler_core import SchedulerCore


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--hog", action="store_true", help="run a busy-looping process beside the engine")
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    model = load_model(a.model)
    core = SchedulerCore(model, ServerArgs(model=model.name))
    for i, ids in enumerate(make_prompts(model, a.concurrency, 128)):
        core.add_request(f"r{i}", ids, SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    hog = mp.get_context("spawn").Process(target=_spin, daemon=True) if a.hog else None
    if hog:
        hog.start()
    steps = []
    while core.has_work:
        core.step()
        if not core.last_step.num_prefill_tokens:
            steps.append(core.last_step.step_seconds * 1000)
    if hog:
        hog.kill()
    print(
        f"hog={a.hog} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}: decode step median "
        f"{statistics.median(steps):.0f} ms, max {max(steps):.0f} ms over {len(steps)} steps"
    )


if __name__ == "__main__":
    main()
