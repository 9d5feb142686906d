"""What a verified draft row costs against a plain decode step, in-process, one stream: the measurement behind
`serving.engine.speculation.DRAFT_ROW_COST` (float weights) and `QUANT_ROW_COST` (a GGUF file in its types).

    .venv/bin/python -m bench.spec_row_cost [--model smollm2-135m] [--dtype float32] [--quantization none]
        [--ks 1 2 3 4 5 6 8] [--rounds 3]

A prompt (bench.speculative's json_extract) is decoded greedily without speculation to learn its output; then
the same request runs with a proposer that drafts exactly that output (every draft token kept), its draft
length held at k.  The step times after the first token are compared: the median step with k draft rows over
the median plain decode step, the arms alternating over the rounds.  Per row: (ratio − 1) / k.  The step
includes all a verify step does (the rows' forward, the acceptance rule over every row, the bookkeeping), so
the ratio is what the draft-length policy weighs.  A benchmark prints numbers; it asserts nothing.
"""

from __future__ import annotations

import os
import statistics
import time

if __name__ == "__main__":  # as the server's Scheduler runs (--thread-wait-policy passive); read when torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.speculative import WORKLOADS, chat_ids
from serving.engine.spec_propose import Proposer


class Replay(Proposer):
    """A proposer that drafts the request's known greedy continuation: every draft token is kept."""

    method = "ngram"

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth

    def propose(self, req, k: int) -> list[int]:
        return self.truth[len(req.seq) : len(req.seq) + k]

    def propose_all(self, asks: list) -> list[list[int]]:
        return [self.truth[len(req.seq) : len(req.seq) + k] for req, k in asks]

    def verified(self, req, proposed: int, accepted: int) -> None:
        """Nothing kept per request."""

    def forget(self, req) -> None:
        """Nothing kept per request."""


def step_times(core, ids: list[int], gen_len: int, tag: str) -> tuple[list[int], list[float]]:
    """(output tokens, wall seconds of each step after the first token) of one greedy request alone; a
    speculated request is held at the longest draft (its estimate of acceptance at 1)."""
    from protocol.sampling_params import SamplingParams

    req = core.add_request(tag, ids, SamplingParams(max_new_tokens=gen_len, temperature=0.0))
    if req.spec is not None:
        req.spec.alpha = 1.0
    out: list[int] = []
    while not out:
        out += [t for ev in core.step() for t in ev.new_token_ids]
    times = []
    while core.has_work:
        t0 = time.perf_counter()
        events = core.step()
        times.append(time.perf_counter() - t0)
        out += [t for ev in events for t in ev.new_token_ids]
    core.flush_cache()
    return out, times


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a name, directory or .gguf file, as --model takes")
    ap.add_argument("--dtype", default="float32", help="as the server's flag")
    ap.add_argument("--quantization", default="none", help="as the server's flag (gguf: a GGUF file in its types)")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--gen-len", type=int, default=64, help="decode steps of the plain arm (drafts: fewer steps)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()

    from serving.args import ServerArgs
    from serving.engine.loader import load_model
    from serving.engine.scheduler_core import SchedulerCore

    loaded = load_model(a.model)
    threads = len(os.sched_getaffinity(0))  # the cores it may run on (taskset), not the machine's
    base = {"model": a.model, "dtype": a.dtype, "quantization": a.quantization, "num_threads": threads}
    off = SchedulerCore(loaded, ServerArgs(**base))
    on = SchedulerCore(loaded, ServerArgs(**base, speculative="ngram", speculative_num_tokens=max(a.ks)))
    ids = chat_ids(loaded.tokenizer, WORKLOADS["json_extract"][1])
    truth, _ = step_times(off, ids, a.gen_len + max(a.ks) + 1, "truth")
    on.spec.proposer = Replay(ids + truth)
    ratios: dict[int, list[float]] = {k: [] for k in a.ks}
    decode_ms = []
    for r in range(a.rounds):
        _, plain = step_times(off, ids, a.gen_len, f"off-{r}")
        decode = statistics.median(plain[1:])
        decode_ms.append(decode * 1e3)
        for k in a.ks if r % 2 == 0 else reversed(a.ks):
            on.spec.max_tokens = k
            out, times = step_times(on, ids, a.gen_len, f"k{k}-{r}")
            assert out == truth[: len(out)], "a replayed draft must give the same tokens"
            ratios[k].append(statistics.median(times[1:-1]) / decode)
    print(
        f"{a.model} {a.dtype} ({a.quantization} quantization), one stream, {threads} thread(s): plain decode step "
        f"{statistics.median(decode_ms):.1f} ms [{min(decode_ms):.1f}-{max(decode_ms):.1f}], medians of {a.rounds}"
    )
    for k in a.ks:
        ratio = statistics.median(ratios[k])
        print(
            f"k={k}: verify step {ratio:.3f}x a decode step [{min(ratios[k]):.3f}-{max(ratios[k]):.3f}], "
            f"{(ratio - 1) / k:.3f} per draft row"
        )


if __name__ == "__main__":
    main()
