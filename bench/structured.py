"""What structured outputs cost the engine, in-process: decode tokens/s of json_schema requests vs free text,
grammar compiles cold and cached, and the grammar mask's fill (llguidance's thread pool vs a call per row).

    .venv/bin/python -m bench.structured [--model smollm2-135m] [--concurrency 1,16] [--rounds 3]

Decode: per concurrency N, N requests (the same `--prompt-len`-token prompts in both arms, no two sharing a
first token; exactly `--gen-len` tokens each, EOS ignored, temperature `--temperature`, seeded) are
prefilled, then only the steps where every request decodes are timed: output tokens / that time, and the
median of those steps (steadier than a total on a busy machine), and their median CPU time (this process's
threads, all of them: what another process's load inflates least).  The json_schema arm's schema (`SCHEMA`: a
list of at least 20 records) is compiled and cached before the timed rounds, and its outputs are longer than
`--gen-len`, so both arms run exactly as many tokens.  The arms alternate over `--rounds` rounds and the
medians are compared (the goal: at least 90 %); the grammar phase's own share of each decode step
(`StepStats.grammar_seconds`: mask fill, mask added to the logits, tokens consumed) is printed too, and so is
the phase with one grammar row among N - 1 free ones (a row without a grammar pays nothing: the phase scales
with the masked rows).

Compile: each of `SCHEMAS` (and `SCHEMA`) compiled cold by a fresh `Grammars` (the tokenizer, built once per
Scheduler, timed apart), then asked for again (a cache hit: a copy of the compiled matcher).

Mask fill: the json_schema arm at the largest concurrency again, its masks filled by llguidance's thread pool
(one call for the batch) or one call per row, alternating over the rounds: the grammar phase per decode step
(the pool's threads can slow the torch ops after them, so the whole phase is what counts).  A benchmark prints
numbers; it asserts nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import time

if __name__ == "__main__":  # as the server's Scheduler runs (--thread-wait-policy passive); read when torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from bench.common import engine_bench_args, in_process_engine, write_json
from protocol.sampling_params import SamplingParams, StructuredOutput
from serving.engine.grammar import PARALLEL_FILL, Grammars
from serving.engine.request import Req
from serving.engine.scheduler_core import SchedulerCore
from telemetry.buckets import DEFAULT_BUCKETS

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "qty": {"type": "integer", "minimum": 0, "maximum": 10000},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"enum": ["new", "used", "sale", "gift"]}, "maxItems": 3},
    },
    "required": ["name", "qty", "price", "tags"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 20}},
    "required": ["items"],
    "additionalProperties": False,
}
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["color", "size"],
    },
    "nested": {
        "type": "object",
        "properties": {"user": ITEM, "friends": {"type": "array", "items": ITEM, "maxItems": 5}},
        "required": ["user"],
    },
    "patterns": {
        "type": "object",
        "properties": {
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z]{2,12}\\.(com|org|net)$"},
            "phone": {"type": "string", "pattern": "^\\+?[0-9]{2,3}-[0-9]{3}-[0-9]{4}$"},
            "when": {"type": "string", "format": "date-time"},
        },
        "required": ["email", "phone", "when"],
    },
    "records": SCHEMA,
}
PHASE: dict[str, list[float]] = {}  # per arm, the decode steps' share of time in the grammar phase
GRAMMAR_MS: list[float] = []  # the decode steps' grammar phase, ms
STEP_MS: dict[str, list[float]] = {}  # per arm, the decode steps with every request in them, ms
PHASE_MS: dict[str, dict[str, list[float]]] = {}  # per arm and phase, those steps' phases, ms
CPU_MS: dict[str, list[float]] = {}  # per arm, those steps' CPU time (every thread of this process), ms


def json_so(schema: dict) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", spec=json.dumps(schema))


def decode_rate(
    core: SchedulerCore, prompts: list[list[int]], gen_len: int, temperature: float, grammar_rows: int, tag: str
) -> float:
    """Output tokens/s over the steps where every request decodes (prefill steps are not timed), the first
    `grammar_rows` requests with `SCHEMA`; each step's time is kept too (`STEP_MS`)."""
    for i, p in enumerate(prompts):
        params = SamplingParams(
            max_new_tokens=gen_len,
            temperature=temperature,
            seed=i,
            ignore_eos=True,
            structured=json_so(SCHEMA) if i < grammar_rows else None,
        )
        core.add_request(f"{tag}-{i}", p, params)
    while core.num_waiting or any(not r.prefill_done for r in core.running):
        core.step()
    tokens, seconds = 0, 0.0
    arm = "json" if grammar_rows == len(prompts) else "free" if not grammar_rows else "one"
    while core.has_work:
        t0, c0 = time.perf_counter(), time.process_time()
        events = core.step()
        seconds += time.perf_counter() - t0
        tokens += sum(len(e.new_token_ids) for e in events)
        if len(events) == len(prompts):
            STEP_MS.setdefault(arm, []).append((time.perf_counter() - t0) * 1e3)
            CPU_MS.setdefault(arm, []).append((time.process_time() - c0) * 1e3)
            st = core.last_step
            for phase in ("forward", "sample", "grammar"):
                PHASE_MS.setdefault(arm, {}).setdefault(phase, []).append(getattr(st, f"{phase}_seconds") * 1e3)
        if core.last_step.step_seconds:
            PHASE.setdefault(arm, []).append(core.last_step.grammar_seconds / core.last_step.step_seconds)
            GRAMMAR_MS.append(core.last_step.grammar_seconds * 1e3)
    core.flush_cache()
    return tokens / seconds


def compile_times(loaded, core: SchedulerCore, rounds: int) -> dict[str, dict[str, float]]:
    """Per schema, median ms of a cold compile (its first mask included) and of a cached one; the tokenizer's
    build apart."""
    out: dict[str, dict[str, list[float]]] = {"tokenizer": {"build": []}}
    for r in range(rounds):
        g = Grammars(loaded.path, core.eos_ids, core.vocab_size, DEFAULT_BUCKETS["stage"])
        t0 = time.perf_counter()
        g.tokenizer()
        out["tokenizer"]["build"].append(time.perf_counter() - t0)
        for name, schema in SCHEMAS.items():
            req = Req(
                rid=f"c{r}{name}",
                input_ids=[1],
                params=SamplingParams(structured=json_so(schema)),
                generator=torch.Generator(),
            )
            t0 = time.perf_counter()
            req.grammar = g.start(req, 0)
            g.wait(60.0)
            g.poll(0)
            cold = time.perf_counter() - t0
            out.setdefault(name, {"cold": [], "cached": []})
            out[name]["cold"].append(cold)
            for _ in range(5):
                t0 = time.perf_counter()
                again = g.start(req, 0)
                out[name]["cached"].append(time.perf_counter() - t0)
                assert again.cache_hit and not again.pending and not req.grammar.pending
        g.close()
    return {k: {kk: statistics.median(v) * 1e3 for kk, v in d.items()} for k, d in out.items()}


def fill_ways(
    core: SchedulerCore, prompts: list[list[int]], gen_len: int, temperature: float, rounds: int
) -> dict[str, float]:
    """Median ms of the grammar phase per decode step with every row json_schema, the masks filled by
    llguidance's thread pool (one call) or one call per row (`Grammars.parallel_fill`), alternating."""
    times: dict[str, list[float]] = {"parallel": [], "per_row": []}
    for r in range(rounds):
        for way in ("parallel", "per_row") if r % 2 else ("per_row", "parallel"):
            core.grammar.parallel_fill = way == "parallel"
            decode_rate(core, prompts, gen_len, temperature, len(prompts), f"fill-{r}-{way}")
            times[way].append(statistics.median(GRAMMAR_MS))
            GRAMMAR_MS.clear()
    core.grammar.parallel_fill = PARALLEL_FILL
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = engine_bench_args(__doc__, gen_len=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    a = ap.parse_args()
    loaded, core, levels, prompts = in_process_engine(a)
    decode_rate(core, prompts[:2], 4, a.temperature, 1, "warmup")  # compiles SCHEMA: cached from here
    doc: dict[str, object] = {"model": a.model, "temperature": a.temperature, "decode": {}}
    for n in levels:
        rates: dict[str, list[float]] = {"free": [], "json": []}
        for r in range(a.rounds):
            for arm in ("free", "json") if r % 2 == 0 else ("json", "free"):
                rates[arm].append(
                    decode_rate(
                        core, prompts[:n], a.gen_len, a.temperature, n if arm == "json" else 0, f"{n}-{r}-{arm}"
                    )
                )
        if n > 1:
            decode_rate(core, prompts[:n], a.gen_len, a.temperature, 1, f"{n}-one")
        free, js = statistics.median(rates["free"]), statistics.median(rates["json"])
        share, one = statistics.median(PHASE["json"]), statistics.median(PHASE.get("one", [0.0]))
        step_free, step_json = statistics.median(STEP_MS["free"]), statistics.median(STEP_MS["json"])
        cpu_free, cpu_json = statistics.median(CPU_MS["free"]), statistics.median(CPU_MS["json"])
        doc["decode"][n] = {
            "tok_s_free": free,
            "tok_s_json": js,
            "ratio": js / free,
            "grammar_phase_share": share,
            "grammar_phase_share_one_row": one if n > 1 else None,
            "median_step_ms_free": step_free,
            "median_step_ms_json": step_json,
            "median_step_ratio": step_free / step_json,
            "median_step_cpu_ms_free": cpu_free,
            "median_step_cpu_ms_json": cpu_json,
            "median_step_cpu_ratio": cpu_free / cpu_json,
            "median_phase_ms": {
                arm: {p: round(statistics.median(v), 3) for p, v in d.items()} for arm, d in PHASE_MS.items()
            },
            "rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        }
        print(
            f"{a.model} c={n}: decode {free:.1f} tok/s free text, {js:.1f} json_schema: ratio {js / free:.3f} "
            f"(medians of {a.rounds} rounds, per round free {doc['decode'][n]['rounds']['free']}, json "
            f"{doc['decode'][n]['rounds']['json']}); median decode step {step_free:.2f} ms free, {step_json:.2f} "
            f"ms json_schema: ratio {step_free / step_json:.3f} (CPU time {cpu_free:.2f} vs {cpu_json:.2f} ms: ratio "
            f"{cpu_free / cpu_json:.3f}); the grammar phase: median {share * 100:.1f} % of "
            f"a decode step" + (f", {one * 100:.1f} % with one json_schema row among {n}" if n > 1 else "")
        )
        PHASE.clear()
        GRAMMAR_MS.clear()
        print(f"  median phases, ms: {doc['decode'][n]['median_phase_ms']}")
        STEP_MS.clear()
        PHASE_MS.clear()
        CPU_MS.clear()
    doc["compile_ms"] = compile_times(loaded, core, a.rounds)
    print(
        f"{a.model} grammar compile, ms (median of {a.rounds}): "
        + "; ".join(f"{k} " + ", ".join(f"{kk} {v:.3f}" for kk, v in d.items()) for k, d in doc["compile_ms"].items())
    )
    n = max(levels)
    doc["grammar_phase_ms_by_fill"] = fill = fill_ways(core, prompts[:n], a.gen_len, a.temperature, a.rounds)
    print(
        f"{a.model} c={n} json_schema: the grammar phase, ms per decode step (median of {a.rounds} rounds' "
        f"medians), masks filled by llguidance's thread pool {fill['parallel']:.3f}, one call per row "
        f"{fill['per_row']:.3f} (the engine's: {'thread pool' if PARALLEL_FILL else 'per row'})"
    )
    if a.json:
        write_json(a.json, doc)


if __name__ == "__main__":
    main()
