"""The decode tail under prefill: inter-token p50/p99 and time to first token, two server configurations
side by side on the same prompts, with where the tail comes from.

    .venv/bin/python -m bench.decode_tail [--concurrency 16,64] [--rounds 3] [--gen-len 64]
        [--before-arg=--step-time-factor=0] [--after-arg=--step-time-factor=2.5] [--json results/bench/decode_tail.json]

Both servers run at once (idle while the other is driven); each round sends every level's prompts (bench.http's
workload: N distinct `--prompt-len`-token prompts, all at once, streaming, exactly `--gen-len` greedy tokens) to
`before`, then to `after`, the prefix cache flushed before each level so every level pays its whole prefill.
Beside the client's numbers (bench/common.py `http_run`), each level reads back from the server:

- the engine steps it ran (GET /debug/timeline): pure-decode and mixed (decode + prefill) step durations, the
  prefill tokens a mixed step carried, and the time between steps (the Scheduler's loop: outputs, stats, GC);
- the decode gaps the server found, by cause (`sightline_decode_gaps_total`, delta over the level).

The table gives each number as the median over rounds and its spread (min–max).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.common import http_run, level_prompts, metric_samples, pct, start_server, write_json
from loadtest.server import free_port
from serving.engine.loader import load_model


@dataclass
class StepShape:
    """What the engine's steps over one level looked like (from /debug/timeline)."""

    steps: int = 0
    mixed_share: float = 0.0  # mixed steps ÷ steps with decodes
    decode_ms_p50: float = float("nan")  # pure-decode steps
    mixed_ms_p50: float = float("nan")  # steps with decodes and prefill chunks
    mixed_ms_p99: float = float("nan")
    mixed_prefill_tokens: float = float("nan")  # mean prefill tokens of a mixed step
    between_ms_p50: float = float("nan")  # from one step's end to the next one's start
    between_ms_p99: float = float("nan")


def step_shape(trace: dict) -> StepShape:
    steps = sorted((e for e in trace["traceEvents"] if e.get("name") == "step"), key=lambda e: e["ts"])
    decoding = [e for e in steps if e["args"]["decode"]]
    pure = [e["dur"] / 1e3 for e in decoding if not e["args"]["prefill_tokens"]]
    mixed = [e for e in decoding if e["args"]["prefill_tokens"]]
    between = [(b["ts"] - a["ts"] - a["dur"]) / 1e3 for a, b in zip(steps, steps[1:])]
    between = [x for x in between if x < 1000]  # an idle wait between two levels is not the loop's
    mixed_ms = [e["dur"] / 1e3 for e in mixed]
    return StepShape(
        steps=len(steps),
        mixed_share=len(mixed) / len(decoding) if decoding else 0.0,
        decode_ms_p50=pct(pure, 0.5),
        mixed_ms_p50=pct(mixed_ms, 0.5),
        mixed_ms_p99=pct(mixed_ms, 0.99),
        mixed_prefill_tokens=statistics.mean(e["args"]["prefill_tokens"] for e in mixed) if mixed else float("nan"),
        between_ms_p50=pct(between, 0.5),
        between_ms_p99=pct(between, 0.99),
    )


def gap_counts(url: str) -> dict[str, float]:
    return {s.labels["cause"]: s.value for s in metric_samples(url, "sightline_decode_gaps_total")}


def run_level(url: str, prompts: list[list[int]], gen_len: int) -> dict:
    """One level against one server: the client's numbers, the steps' shape and the decode gaps by cause."""
    httpx.post(url + "/flush_cache", timeout=30).raise_for_status()
    before = gap_counts(url)
    r = asyncio.run(http_run(url, prompts, gen_len))
    after = gap_counts(url)
    trace = httpx.get(url + "/debug/timeline", params={"seconds": r["wall"] + 1}, timeout=60).json()
    itl = r["itl"]
    return {
        "ttft_p50_ms": statistics.median(r["ttft"]),
        "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99),
        "ratio": pct(itl, 0.99) / pct(itl, 0.5),
        "tok_s": r["tok_s"],
        "steps": asdict(step_shape(trace)),
        "gaps": {c: after[c] - before.get(c, 0.0) for c in after if after[c] - before.get(c, 0.0)},
    }


COLUMNS = (
    ("ITL p50 ms", "itl_p50_ms", "{:.0f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.0f}"),
    ("p99/p50", "ratio", "{:.2f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("output tok/s", "tok_s", "{:.1f}"),
)
STEP_COLUMNS = (
    ("steps", "steps", "{:.0f}"),
    ("mixed share", "mixed_share", "{:.2f}"),
    ("decode step ms", "decode_ms_p50", "{:.0f}"),
    ("mixed step ms p50", "mixed_ms_p50", "{:.0f}"),
    ("mixed step ms p99", "mixed_ms_p99", "{:.0f}"),
    ("prefill tokens / mixed step", "mixed_prefill_tokens", "{:.0f}"),
    ("between steps ms p50 / p99", None, None),
)


def spread(xs: list[float], fmt: str) -> str:
    """The median over rounds, and min–max when there are several."""
    med = fmt.format(statistics.median(xs))
    return med if len(xs) < 2 else f"{med} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def tables(results: dict[str, dict[int, list[dict]]]) -> str:
    """The client's numbers, then the steps' shape and the decode gaps, one row per configuration and level."""
    head = "| config | c | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(COLUMNS)]
    for name, levels in results.items():
        for n, runs in levels.items():
            lines.append(
                f"| {name} | {n} | " + " | ".join(spread([r[k] for r in runs], f) for _, k, f in COLUMNS) + " |"
            )
    lines += ["", "| config | c | " + " | ".join(c[0] for c in STEP_COLUMNS) + " | decode gaps by cause |"]
    lines.append("|---|---:|" + "---:|" * len(STEP_COLUMNS) + "---|")
    for name, levels in results.items():
        for n, runs in levels.items():
            s = [r["steps"] for r in runs]
            cells = [spread([x[k] for x in s], f) for _, k, f in STEP_COLUMNS if k is not None]
            cells.append(
                f"{statistics.median(x['between_ms_p50'] for x in s):.1f} / "
                f"{statistics.median(x['between_ms_p99'] for x in s):.1f}"
            )
            causes = sorted({c for r in runs for c in r["gaps"]})
            gaps = ", ".join(f"{c} {statistics.median(r['gaps'].get(c, 0) for r in runs):.0f}" for c in causes)
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + f" | {gaps or 'none'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-arg", action="append", default=None, metavar="FLAG", help="the before server's flags")
    ap.add_argument("--after-arg", action="append", default=None, metavar="FLAG", help="the after server's flags")
    ap.add_argument("--only", choices=("before", "after"), help="start and drive one of the two servers only")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    configs = {
        "before": a.before_arg if a.before_arg is not None else ["--step-time-factor=0"],
        "after": a.after_arg if a.after_arg is not None else [],  # the defaults: the time budget on
    }
    if a.only:
        configs = {a.only: configs[a.only]}
    levels = [int(x) for x in a.concurrency.split(",")]
    prompts = level_prompts(load_model(a.model), levels, a.prompt_len)
    results: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in levels} for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for name, flags in configs.items():
                servers[name] = start_server(a.model, free_port(), Path(tmp) / f"{name}.log", flags)
                # warm-up: one burst like the first level's (its prompts reversed: nothing of them cached), short,
                # so the step budget's cost fit has seen mixed and pure-decode steps, as on a server in service
                # (right after a start it runs the floor for its first steps: docs/engine.md, step budget)
                asyncio.run(http_run(servers[name].url, [p[::-1] for p in prompts[levels[0]]], 16))
            for _ in range(a.rounds):
                for name, server in servers.items():
                    for n in levels:
                        results[name][n].append(run_level(server.url, prompts[n], a.gen_len))
        finally:
            for server in servers.values():
                server.stop()
    if a.json:
        write_json(a.json, {"model": a.model, "configs": configs, "prompt_len": a.prompt_len, "results": results})
    flags = "; ".join(f"{k}: {' '.join(v) or '(defaults)'}" for k, v in configs.items())
    print(f"model {a.model}, prompt {a.prompt_len} tokens, {a.gen_len} new tokens, {a.rounds} rounds; {flags}\n")
    print(tables(results))


if __name__ == "__main__":
    main()
