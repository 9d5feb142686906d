"""What log-probabilities cost the engine, in-process: decode tokens/s with logprobs=5 vs without, and a
prompt-logprobs prefill vs a plain one on the same prompt.

    .venv/bin/python -m bench.logprobs [--model smollm2-135m] [--concurrency 1,16] [--rounds 3]

Decode: per concurrency N, N requests (the same `--prompt-len`-token prompts in both arms, no two sharing
a first token; exactly `--gen-len` greedy tokens each, EOS ignored) are prefilled, then only the steps
where every request decodes are timed; output tokens / that time.  The arms alternate over `--rounds`
rounds and the medians are compared (the goal: logprobs cost at most 10 %); the logprobs phase's own
share of each decode step (`StepStats.logprobs_seconds`) is printed too, steadier than the rates on a
busy machine.

Prefill: one `--prefill-len`-token prompt's time to its first token (every step until it), plain and with
prompt_logprobs=5, each with the prefix cache cold (flushed) and warm (the same prompt just served): a
prompt-logprobs request recomputes what the cache holds (its logits are needed), so warm it costs what a
cold prefill does, plus the scoring.  A benchmark prints numbers; it asserts nothing.
"""

from __future__ import annotations

import os
import statistics
import time

if __name__ == "__main__":  # as the server's Scheduler runs (--thread-wait-policy passive); read when torch loads.
    # Without it OpenMP's threads spin after the logprobs ops and slow the next forward's kernel team by ~40 %.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.common import engine_bench_args, in_process_engine, make_prompts, write_json
from protocol.sampling_params import SamplingParams
from serving.engine.scheduler_core import SchedulerCore

PHASE: list[float] = []  # the decode steps' share of time in the logprobs phase (StepStats.logprobs_seconds)


def decode_rate(core: SchedulerCore, prompts: list[list[int]], gen_len: int, logprobs: int | None, tag: str) -> float:
    """Output tokens/s over the steps where every request decodes (prefill steps are not timed)."""
    params = SamplingParams(max_new_tokens=gen_len, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    while core.num_waiting or any(not r.prefill_done for r in core.running):
        core.step()
    tokens, seconds = 0, 0.0
    while core.has_work:
        t0 = time.perf_counter()
        events = core.step()
        seconds += time.perf_counter() - t0
        tokens += sum(len(e.new_token_ids) for e in events)
        if logprobs is not None and core.last_step.step_seconds:
            PHASE.append(core.last_step.logprobs_seconds / core.last_step.step_seconds)
    core.flush_cache()
    return tokens / seconds


def time_to_first_token(core: SchedulerCore, prompt: list[int], prompt_logprobs: int | None, tag: str) -> float:
    """Seconds of the steps until the request's first token (it then stops: max_new_tokens 1)."""
    core.add_request(tag, prompt, SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs))
    t0 = time.perf_counter()
    core.run_to_completion()
    return time.perf_counter() - t0


def prefill_costs(core: SchedulerCore, prompt: list[int], rounds: int) -> dict[str, float]:
    """Median ms to the first token, per (cache state, plain or prompt_logprobs=5)."""
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        for lp in (None, 5):
            name = "plain" if lp is None else "prompt_logprobs"
            core.flush_cache()
            times.setdefault(f"cold {name}", []).append(time_to_first_token(core, prompt, lp, f"c{r}{name}"))
            time_to_first_token(core, prompt, None, f"fill{r}{name}")  # the cache now holds the prompt
            times.setdefault(f"warm {name}", []).append(time_to_first_token(core, prompt, lp, f"w{r}{name}"))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = engine_bench_args(__doc__, gen_len=32)
    ap.add_argument("--prefill-len", type=int, default=256)
    a = ap.parse_args()
    loaded, core, levels, prompts = in_process_engine(a)
    decode_rate(core, prompts[:2], 4, 5, "warmup")
    doc: dict[str, object] = {"model": a.model, "decode": {}, "prefill_ms": {}}
    for n in levels:
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(a.rounds):
            for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
                rates[arm].append(
                    decode_rate(core, prompts[:n], a.gen_len, 5 if arm == "on" else None, f"{n}-{r}-{arm}")
                )
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        share = statistics.median(PHASE)
        doc["decode"][n] = {"tok_s_without": off, "tok_s_logprobs5": on, "ratio": on / off, "phase_share": share}
        print(
            f"{a.model} c={n}: decode {off:.1f} tok/s without logprobs, {on:.1f} with logprobs=5: "
            f"ratio {on / off:.3f} (cost {(1 - on / off) * 100:+.1f} %; medians of {a.rounds} rounds, per round "
            f"off {[round(x, 1) for x in rates['off']]}, on {[round(x, 1) for x in rates['on']]}); the logprobs "
            f"phase, timed in the step: median {share * 100:.1f} % of a decode step"
        )
        PHASE.clear()
    (prompt,) = make_prompts(loaded, 1, a.prefill_len, start=max(levels))
    costs = prefill_costs(core, prompt, a.rounds)
    doc["prefill_ms"] = costs
    print(
        f"{a.model}, {a.prefill_len}-token prompt, ms to the first token (median of {a.rounds}): "
        + ", ".join(f"{k} {v:.1f}" for k, v in costs.items())
    )
    if a.json:
        write_json(a.json, doc)


if __name__ == "__main__":
    main()
