"""Engine benchmark: our continuous-batching engine in-process vs transformers' `generate`.

    .venv/bin/python -m bench.engine [--model smollm2-135m] [--concurrency 1,8,32,64]

For each concurrency N, N requests (`--prompt-len`-token prompts, each beginning with a
different token so the prefix cache reuses nothing; exactly `--gen-len` greedy tokens
each, EOS ignored) are submitted at once and the engine is stepped until idle.  Printed
per row: output tokens/s, prefill tokens/s (prefill-only steps), mean decode step time,
the achieved FLOP/s and bytes/s (the steps' analytic work, as the Scheduler counts it) as
fractions of the machine's peak (measured once, as the Scheduler does at start), what counting
that work costs per step, and peak RSS.  The baseline runs the same prompts through `model.generate` one request at a
time; its rate does not depend on N, so it is measured once on `--baseline-requests`
prompts and every row shows our ratio to it.
A benchmark prints numbers; it asserts nothing (goals are checked by reading them).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

if __name__ == "__main__":  # as the server's Scheduler runs (--thread-wait-policy passive); read when torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from bench.common import make_prompts, write_json
from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.engine import peak_probe
from serving.engine.loader import LoadedModel, load_model
from serving.engine.scheduler_core import SchedulerCore
from serving.engine.utilisation import ModelShape, phase_work


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


MODES = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "gguf": ("auto", "gguf"),  # a .gguf model in its own types
    **{q: ("auto", q) for q in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")},
}


def run_engine(
    model: LoadedModel,
    prompts: list[list[int]],
    gen_len: int,
    threads: int | None,
    mode: str = "float32",
    attention: str = "auto",
    linear: str = "auto",
    peak: peak_probe.Peak | None = None,
) -> dict:
    n = len(prompts)
    dtype, quant = MODES[mode]
    args = ServerArgs(
        model=model.name,
        max_running_requests=max(n, 1),
        max_prefill_tokens=512,
        max_total_tokens=max(4096, n * (len(prompts[0]) + gen_len)),
        num_threads=threads,
        dtype=dtype,
        quantization=quant,
        attention_backend=attention,
        linear_backend=linear,
    )
    core = SchedulerCore(model, args)
    shape = ModelShape.served(model.hf_model.config, core.runner.precision.dtype, core.runner.precision.quantization)
    flops = moved = count_s = 0.0
    params = SamplingParams(max_new_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, params)
    prefill_s = decode_s = 0.0
    prefill_tokens = decode_steps = out_tokens = steps = 0
    t0 = time.perf_counter()
    while core.has_work:
        out_tokens += sum(len(ev.new_token_ids) for ev in core.step())
        st = core.last_step
        steps += 1
        c0 = time.perf_counter()  # what the Scheduler's step observer adds: the step's work counted
        work = phase_work(shape, st.num_decode, st.tokens, st.starts, st.num_sampled).values() if st.tokens else ()
        count_s += time.perf_counter() - c0
        flops += sum(w.flops for w in work)
        moved += sum(w.bytes for w in work)
        if st.num_prefill_tokens and not st.num_decode:
            prefill_s += st.step_seconds
            prefill_tokens += st.num_prefill_tokens
        elif not st.num_prefill_tokens:
            decode_s += st.step_seconds
            decode_steps += 1
    wall = time.perf_counter() - t0
    assert core.pool.is_idle()  # every request gave its KV back (the prefix cache keeps what it holds)
    return {
        "out_tok_s": out_tokens / wall,
        "prefill_tok_s": prefill_tokens / prefill_s if prefill_s else float("nan"),
        "step_ms": 1000 * decode_s / decode_steps if decode_steps else float("nan"),
        "wall_s": wall,
        "flops_of_peak": flops / wall / peak.flops if peak else float("nan"),
        "bytes_of_peak": moved / wall / peak.bytes_per_second if peak else float("nan"),
        "count_us_per_step": 1e6 * count_s / max(1, steps),
        "prefix_hit_tokens": core.batches.prefix_hits_tokens,  # 0: distinct prompts, nothing reused
    }


def run_baseline(model: LoadedModel, prompts: list[list[int]], gen_len: int) -> float:
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,
                do_sample=False,
                pad_token_id=model.tokenizer.eos_token_id,
            )
            tokens += out.shape[1] - len(ids)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--baseline-requests", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--modes", default="float32", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument(
        "--attention",
        default="auto",
        help="comma-separated decode-attention backends to compare, of auto, native, sdpa",
    )
    ap.add_argument(
        "--linear",
        default="auto",
        help="comma-separated linear-layer backends to compare, of auto, native, torch (float32 only)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = load_model(a.model)
    print(
        f"model {model.name}: loaded in {time.perf_counter() - t0:.1f} s "
        f"({'cold: converted' if model.converted else 'warm: from cache'}), threads={torch.get_num_threads()}"
    )
    levels = [int(x) for x in a.concurrency.split(",")]
    run_engine(model, make_prompts(model, 2, a.prompt_len), 8, a.threads)  # warm-up
    peak = peak_probe.measure()
    print(
        f"machine peak on {torch.get_num_threads()} threads: {peak.flops / 1e9:.1f} GFLOP/s (float32 GEMM), "
        f"{peak.bytes_per_second / 1e9:.1f} GB/s (memory copy)"
    )
    base = run_baseline(model, make_prompts(model, a.baseline_requests, a.prompt_len), a.gen_len)
    print(f"baseline: transformers generate, sequential, {a.baseline_requests} requests: {base:.1f} output tok/s")
    print(f"prompt {a.prompt_len} tokens, {a.gen_len} new tokens per request\n")
    print(
        "| mode | linear | attention | concurrency | output tok/s | vs baseline | prefill tok/s | decode step ms "
        "| FLOP/s of peak | bytes/s of peak | count µs/step | wall s | peak RSS MiB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for mode in a.modes.split(","):
        for n in levels:
            for attn, lin in ((x, y) for x in a.attention.split(",") for y in a.linear.split(",")):
                if mode != "float32" and lin == "native":
                    continue  # the native linear kernel is float32 only
                # innermost: backends compared back to back
                r = run_engine(model, make_prompts(model, n, a.prompt_len), a.gen_len, a.threads, mode, attn, lin, peak)
                rows.append(
                    {
                        "mode": mode,
                        "linear": lin,
                        "attention": attn,
                        "concurrency": n,
                        **r,
                        "baseline_tok_s": base,
                        "peak_rss_mib": peak_rss_mib(),
                    }
                )
                print(
                    f"| {mode} | {lin} | {attn} | {n} | {r['out_tok_s']:.1f} | {r['out_tok_s'] / base:.2f}x | "
                    f"{r['prefill_tok_s']:.0f} | {r['step_ms']:.1f} | {r['flops_of_peak']:.1%} | "
                    f"{r['bytes_of_peak']:.1%} | {r['count_us_per_step']:.0f} | {r['wall_s']:.1f} | "
                    f"{peak_rss_mib():.0f} |",
                    flush=True,
                )
    if a.json:
        write_json(
            a.json,
            {
                "model": model.name,
                "prompt_len": a.prompt_len,
                "gen_len": a.gen_len,
                "cpu": torch.backends.cpu.get_cpu_capability(),
                "rows": rows,
                "peak_flops": peak.flops,
                "peak_bytes_per_second": peak.bytes_per_second,
            },
        )


if __name__ == "__main__":
    main()
