"""What KV-cache events cost the engine: the same decode workload with `--kv-events-endpoint` on
(the prefix cache tells a recorder of every store and eviction, the Scheduler hands each step's
events to the publisher, a subscriber reads them all) and off, alternating, in-process.

    .venv/bin/python -m bench.kv_events [--model smollm2-135m] [--concurrency 16] [--rounds 5] [--json PATH]

Each round keeps `--concurrency` requests decoding together (a new one, with a prompt of its
own, replaces each that finishes, so blocks are stored all the time, and evicted once the pool
is full) for `--steps` steps; output tok/s = tokens sampled ÷ wall time.  On and off run back to
back in each round (alternating which goes first); the result is the median of the rounds'
on ÷ off ratios, which a busy machine's drift between rounds does not move.  The goal is ≥ 0.98.

The subscriber stands for a cache-aware router, which runs on a machine of its own: with two or
more CPUs it gets the last one (`--subscriber-cpu`) and the engine, with its publisher thread,
the others (as many compute threads as it has CPUs), so the cost measured is the engine's.  On
one CPU everything shares it, and the ratio includes the router's work too.  Beside the ratio:
the Scheduler thread's time in the event hooks (the recorder's hashing, the hand-off to the
publisher) and the publisher thread's CPU time, each per step, and CPU per output token of the
engine's process, which on a shared machine moves less than wall time.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import statistics
import tempfile
import time

if __name__ == "__main__":  # as the server's Scheduler runs (--thread-wait-policy passive); read when torch loads.
    # Without it OpenMP's threads spin while the publisher's thread has the core, and the engine pays for it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import zmq

from bench.common import engine_bench_args, in_process_engine, write_json
from protocol.sampling_params import SamplingParams
from serving.engine.kv_event_publisher import KVEventPublisher, KVEvents
from serving.engine.kv_events import KVEventRecorder
from serving.engine.scheduler_core import SchedulerCore
from serving.engine.utilisation import ModelShape, phase_work


def placement(subscriber_cpu: int | None) -> tuple[list[int], int | None]:
    """(the engine's CPUs, the subscriber's): the subscriber on a CPU of its own when there are two or more."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return cpus, None
    sub = cpus[-1] if subscriber_cpu is None else subscriber_cpu
    if sub not in cpus:
        raise SystemExit(f"--subscriber-cpu {sub}: not one of this process's CPUs {cpus}")
    return [c for c in cpus if c != sub], sub


class TimedRecorder(KVEventRecorder):
    """The recorder, with the Scheduler thread's CPU time in its hooks summed (`hook_ns`)."""

    hook_ns = 0

    def stored(self, ids, start, ns) -> None:
        t = time.thread_time_ns()
        super().stored(ids, start, ns)
        self.hook_ns += time.thread_time_ns() - t

    def removed(self, ids, start, ns) -> None:
        t = time.thread_time_ns()
        super().removed(ids, start, ns)
        self.hook_ns += time.thread_time_ns() - t


def thread_cpu_ns(thread) -> int:
    """CPU time the (running) thread has used."""
    return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))


def utilisation_us(loaded, concurrency: int, context: int) -> float:
    """µs per step of the utilisation counters (always on): `phase_work` for a step of `concurrency` decodes."""
    shape = ModelShape.served(loaded.hf_model.config, "float32", "none")
    tokens, starts, n = (1,) * concurrency, (context,) * concurrency, 2000
    t = time.perf_counter_ns()
    for _ in range(n):
        phase_work(shape, concurrency, tokens, starts, concurrency)
    return (time.perf_counter_ns() - t) / n / 1e3


def drain(endpoint: str, stop, got, cpu: int | None) -> None:
    """The subscriber, in a process of its own (as a router is): reads every batch until `stop` is set."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        while not stop.is_set():
            if sub.poll(50):
                sub.recv_multipart()
                got.value += 1
        sub.setsockopt(zmq.LINGER, 0)


def run(
    core: SchedulerCore, events: KVEvents | None, steps: int, concurrency: int, prompt_len: int, start: int
) -> tuple[float, float, float, float]:
    """(output tok/s, CPU µs per output token, Scheduler-thread CPU µs in the event hooks per step, publisher-thread
    CPU µs per step) over `steps` steps with the batch kept full; `events` None: the flag off."""
    core.tree.events = events.recorder if events is not None else None
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    n, tokens, send_ns = start, 0, 0
    hook0 = events.recorder.hook_ns if events is not None else 0
    pub0 = thread_cpu_ns(events.publisher._thread) if events is not None else 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        while core.num_running + core.num_waiting < concurrency:
            rng = random.Random(n)  # a prompt of its own: no run reuses another's cached blocks
            core.add_request(f"r{n}", [rng.randrange(3, 4000) for _ in range(prompt_len)], params)
            n += 1
        tokens += sum(len(ev.new_token_ids) for ev in core.step())
        if events is not None:
            t = time.thread_time_ns()
            events.send()
            send_ns += time.thread_time_ns() - t
    while events is not None and events.publisher.backlog:  # the publisher's work counts, however late it runs
        time.sleep(0.001)  # clock: polling the publisher's queue
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    hook = pub = 0.0
    if events is not None:
        hook = (events.recorder.hook_ns - hook0 + send_ns) / steps / 1e3
        pub = (thread_cpu_ns(events.publisher._thread) - pub0) / steps / 1e3
    for rid in list(core.reqs):
        core.abort(rid)
    return tokens / elapsed, cpu / tokens * 1e6, hook, pub


def main() -> None:
    ap = engine_bench_args(__doc__, gen_len=64)
    ap.set_defaults(concurrency="16")
    ap.set_defaults(rounds=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--subscriber-cpu", type=int, help="the subscriber's CPU (default: the last of two or more)")
    a = ap.parse_args()
    engine_cpus, sub_cpu = placement(a.subscriber_cpu)
    os.sched_setaffinity(0, engine_cpus)  # before the engine's threads start: they inherit it
    loaded, core, levels, _ = in_process_engine(a, threads=len(engine_cpus))
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kv-bench-')}/events"
    publisher = KVEventPublisher(endpoint)
    events = KVEvents(TimedRecorder(), publisher)
    spawn = multiprocessing.get_context("spawn")
    stop, got = spawn.Event(), spawn.Value("i", 0)
    reader = spawn.Process(target=drain, args=(endpoint, stop, got, sub_cpu), daemon=True)
    reader.start()
    where = f"CPU {sub_cpu}" if sub_cpu is not None else "the same CPU"
    print(f"engine on CPUs {engine_cpus} ({len(engine_cpus)} compute threads), subscriber on {where}")
    doc: dict = {
        "model": a.model,
        "steps": a.steps,
        "rounds": a.rounds,
        "engine_cpus": engine_cpus,
        "subscriber_cpu": sub_cpu,
        "levels": {},
    }
    try:
        for c in levels:
            run(core, events, 20, c, a.prompt_len, 0)  # warm up
            results: dict[bool, list[tuple[float, float, float, float]]] = {True: [], False: []}
            for r in range(a.rounds):
                for on in (True, False) if r % 2 else (False, True):
                    start = 1_000_000 * (2 * r + on + 1) + 100_000 * c
                    results[on].append(run(core, events if on else None, a.steps, c, a.prompt_len, start))
            pairs = list(zip(results[True], results[False]))
            tok = statistics.median(x[0] / y[0] for x, y in pairs)
            cpu = statistics.median(x[1] / y[1] for x, y in pairs)
            on, off = (statistics.median(x[0] for x in results[k]) for k in (True, False))
            hook, pub = (statistics.median(x[i] for x in results[True]) for i in (2, 3))
            print(
                f"{a.model}, c={c}: {on:.1f} tok/s with KV events, {off:.1f} without; tok/s on/off {tok:.3f}, CPU "
                f"per output token on/off {cpu:.3f} (medians of the {a.rounds} rounds' ratios, each pair run back "
                f"to back, {a.steps} steps a run; tok/s per round on {[round(x[0]) for x in results[True]]}, off "
                f"{[round(x[0]) for x in results[False]]})"
            )
            util = utilisation_us(loaded, c, a.prompt_len + a.gen_len // 2)
            step_us = 1e6 * c / off
            print(
                f"  per step with events: {hook:.1f} µs CPU in the Scheduler thread's hooks, {pub:.1f} µs CPU of the "
                f"publisher thread; the utilisation counters (always on) {util:.1f} µs; a step takes "
                f"{step_us:.0f} µs off ({100 * (hook + pub + util) / step_us:.2f} % all three)"
            )
            doc["levels"][str(c)] = {
                "on_tok_s": on,
                "off_tok_s": off,
                "tok_s_ratio": tok,
                "cpu_per_token_ratio": cpu,
                "hook_us_per_step": hook,
                "publisher_cpu_us_per_step": pub,
                "utilisation_us_per_step": util,
                "on": results[True],
                "off": results[False],
            }
        print(f"events published {publisher.published}, dropped {publisher.dropped}, batches read {got.value}")
        doc.update(published=publisher.published, dropped=publisher.dropped)
    finally:
        stop.set()
        reader.join(5)
        publisher.close()
    if a.json:
        write_json(a.json, doc)


if __name__ == "__main__":
    main()
