"""Pipeline overhead: the same requests through HTTP+ZMQ+3 processes vs the engine in-process.

    .venv/bin/python -m bench.http [--model smollm2-135m] [--concurrency 1,32] [--url URL]

For each concurrency N, N distinct `--prompt-len`-token prompts ask for exactly
`--gen-len` greedy tokens (EOS ignored), all at once.  In-process: `SchedulerCore`
stepped until idle, TTFT = add_request → first token sampled.  HTTP: streaming
`/v1/completions` against a server this script starts (or `--url`), TTFT = request
sent → first SSE chunk with text received, ITL = gaps between such chunks.  Output
tok/s = all output tokens ÷ wall time.  The engine runs first, then the server, so the two
never share the CPU.  The prompts, client and workload are bench/common.py's (`run_levels`),
which bench/peers.py points at transformers and llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import (
    TABLE_HEAD,
    cpu_seconds,
    level_prompts,
    make_prompts,
    run_levels,
    start_server,
    table_row,
    write_json,
)
from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.engine.loader import load_model
from serving.engine.scheduler_core import SchedulerCore


def engine_run(model, prompts: list[list[int]], gen_len: int) -> dict:
    core = SchedulerCore(model, ServerArgs(model=model.name))
    params = SamplingParams(max_new_tokens=gen_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [core.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    events = core.run_to_completion()
    wall = time.perf_counter() - t0
    ttft = [(r.times.first_token - r.times.queued) / 1e6 for r in reqs]
    return {"ttft": ttft, "tok_s": sum(len(e.new_token_ids) for e in events) / wall, "wall": wall}


def engine_info(url: str) -> dict[str, str]:
    """What the server's engine computes in (`sightline_engine_info` labels: dtype, quantization)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return next(
        (
            {k: s.labels[k] for k in ("dtype", "quantization")}
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "sightline_engine_info"
        ),
        {},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the server this script starts, e.g. --server-arg=--dtype=bfloat16 (repeatable)",
    )
    ap.add_argument("--skip-engine", action="store_true", help="only the HTTP pipeline")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    model = load_model(a.model)
    rows: dict[int, dict] = {n: {} for n in levels}
    prompts = level_prompts(model, levels, a.prompt_len)
    if not a.skip_engine:
        engine_run(model, make_prompts(model, 2, a.prompt_len, start=sum(levels)), 4)  # warm-up
        for n in levels:
            rows[n]["engine"] = engine_run(model, prompts[n], a.gen_len)
    del model
    with tempfile.TemporaryDirectory() as tmp:
        server = None if a.url else start_server(a.model, a.port, Path(tmp) / "server.log", a.server_arg)
        url = a.url or server.url
        try:
            for n, r in run_levels(url, prompts, a.gen_len, cpu_probe=lambda: cpu_seconds(url)).items():
                rows[n]["http"] = r
            info = engine_info(url)
        finally:
            if server is not None:
                server.stop()
    if a.json:
        write_json(
            a.json,
            {
                "model": a.model,
                "server_args": a.server_arg,
                "engine_info": info,
                "prompt_len": a.prompt_len,
                "gen_len": a.gen_len,
                "levels": rows,
            },
        )
    print(
        f"model {a.model}, prompt {a.prompt_len} tokens, {a.gen_len} new tokens per request, "
        f"{os.cpu_count()} CPUs, server flags: {' '.join(a.server_arg) or '(defaults)'}, engine: "
        f"{' '.join(f'{k}={v}' for k, v in info.items()) or '?'}\n"
    )
    print(TABLE_HEAD)
    for n in levels:
        for path in rows[n]:
            print(table_row(n, "in-process engine" if path == "engine" else "HTTP + ZMQ pipeline", rows[n][path]))
        cpu = rows[n]["http"]["cpu_per_1k"]
        print(
            f"| {n} | CPU s per 1000 output tokens | "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()))
            + " | | | | | |"
        )
        if "engine" not in rows[n]:
            continue
        e, h = rows[n]["engine"], rows[n]["http"]
        print(
            f"| {n} | overhead | {statistics.median(h['ttft']) - statistics.median(e['ttft']):+.0f} | | | | "
            f"{100 * (h['tok_s'] / e['tok_s'] - 1):+.1f}% | |"
        )


if __name__ == "__main__":
    main()
