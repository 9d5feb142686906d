"""The Scheduler's per-step cost of explaining waits and gaps: the same engine steps with the
decode-gap detection and the step timeline's ring on (as `--step-timeline-steps 4096` runs them)
and off (`--step-timeline-steps 0`), alternating, in-process.

    .venv/bin/python -m bench.step_bookkeeping [--model tiny-random] [--concurrency 16] [--rounds 6]

Each round runs `--concurrency` requests that decode together (a new one replaces each that
finishes, so the batch stays full) for `--steps` steps and reports the mean step time
(`SchedulerCore.step` plus the bookkeeping after it). Wait reasons are assigned inside the
step and are on in both modes; they cost one comparison per waiting request per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.engine.decode_gaps import DecodeGaps
from serving.engine.loader import load_model
from serving.engine.scheduler_core import SchedulerCore
from telemetry.step_timeline import StepRing

BOOKKEEPING: list[float] = []  # seconds per step after `SchedulerCore.step` (the bookkeeping alone when on)


def run(core: SchedulerCore, on: bool, steps: int, concurrency: int, start: int) -> float:
    gaps, ring = DecodeGaps(), StepRing(4096)
    trace_of: dict[str, str] = {}
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    n = start
    t_total = 0.0
    for _ in range(steps):
        while core.num_running + core.num_waiting < concurrency:
            rid = f"r{n}"
            core.add_request(rid, [3 + (n * 7 + j) % 500 for j in range(16)], params)
            trace_of[rid] = f"{n:032x}"
            n += 1
        t0 = time.perf_counter()
        events = core.step()
        t1 = time.perf_counter()
        if on:
            st = core.last_step
            traces = tuple(trace_of.get(r, "") for r in st.rids)
            gaps.stepped(st, events)
            ring.add(st, traces, 0)
        t2 = time.perf_counter()
        t_total += t2 - t0
        if on:
            BOOKKEEPING.append(t2 - t1)
    core.run_to_completion()
    return t_total / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    loaded = load_model(a.model)
    core = SchedulerCore(loaded, ServerArgs(model=a.model, dtype="float32"))
    run(core, True, 50, a.concurrency, 0)  # warm up
    results: dict[bool, list[float]] = {True: [], False: []}
    for r in range(a.rounds):
        for on in (True, False) if r % 2 else (False, True):
            results[on].append(run(core, on, a.steps, a.concurrency, 10_000 * (2 * r + on + 1)))
    on, off = statistics.median(results[True]), statistics.median(results[False])
    print(
        f"{a.model}, c={a.concurrency}: step {on:.3f} ms with decode gaps + step ring, {off:.3f} ms without "
        f"({(on - off) / off * 100:+.1f} %; medians of {a.rounds} rounds of {a.steps} steps, per round: "
        f"on {[round(x, 3) for x in results[True]]}, off {[round(x, 3) for x in results[False]]})"
    )
    alone = statistics.median(BOOKKEEPING)
    mean = statistics.mean(BOOKKEEPING)
    print(
        f"the bookkeeping itself, timed alone: median {alone * 1e6:.1f} µs, mean {mean * 1e6:.1f} µs per step"
        f" ({alone * 1e3 / off * 100:.2f} % of the step)"
    )


if __name__ == "__main__":
    main()
