"""The fp32 linear layers per shape, native kernel against torch's matmul, and the machine's roofline.

    .venv/bin/python -m bench.kernels [--model smollm2-135m] [--rows 1,16,64,512] [--json results/bench/kernels.json]

For each linear shape of the model (fused QKV, O, fused gate/up, down, lm_head) and each row
count M (one decode stream, a 16- and a 64-request decode batch, a prefill chunk) it times
`torch.nn.functional.linear` and the native kernel (`serving/models/layers/native_linear.py`)
on the same inputs, interleaved, median of `--repeats` rounds, and prints ms, GFLOP/s, weight
GB/s and the speed-up.  The roofline: the memory bandwidth (a streaming read of a 1 GiB
tensor, a sum) and the fp32 matmul peak (the better of torch's and the native kernel's on a
large compute-bound shape), both on the engine's thread count; `bench.table` divides each
server's c=1 weight bytes/s and c=64 FLOP/s by them (`linear_params` in the JSON: the weights
a decode step multiplies by, lm_head included).  `--quant` adds the quantized kernel per GGUF
type against weight-only int8 (`bench.kernels_quant`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from bench.common import write_json
from bench.kernels_quant import compare_quant, types
from serving.model_files import BUNDLED_MODEL, prepare_model_dir
from serving.models.base import ModelDims
from serving.models.layers import native, native_quant
from serving.models.layers.native_linear import NativeLinear


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def shapes(model: str) -> tuple[dict[str, tuple[int, int]], int]:
    """(N, K) of each linear layer the model runs, fused as the engine fuses them, and its layer count."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(prepare_model_dir(model)[0])
    dims = ModelDims.from_hf_config(cfg)
    q, kv, inter = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, cfg.intermediate_size
    return {
        "qkv": (q + 2 * kv, dims.hidden),
        "o": (dims.hidden, q),
        "gate_up": (2 * inter, dims.hidden),
        "down": (dims.hidden, inter),
        "lm_head": (dims.vocab_size, dims.hidden),
    }, dims.num_layers


def linear_params(layers: dict[str, tuple[int, int]], num_layers: int) -> int:
    """Weights a decode step multiplies by: every layer's linears and the lm_head (2 FLOP each per token)."""
    return (
        sum(n * k for name, (n, k) in layers.items() if name != "lm_head") * num_layers
        + layers["lm_head"][0] * layers["lm_head"][1]
    )


def _time(fn: Callable[[], object], min_seconds: float = 0.05) -> float:
    """Seconds per call: enough calls to fill `min_seconds`, after one warm-up call."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed / n


def compare(kernel: NativeLinear, n: int, k: int, m: int, repeats: int) -> dict:
    x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
    packed = kernel.pack(w)
    torch_s, native_s = [], []
    with torch.inference_mode():
        for _ in range(repeats):  # interleaved: both see the same machine state
            torch_s.append(_time(lambda: F.linear(x, w)))
            native_s.append(_time(lambda: kernel(x, packed, None, n)))
    t, nat = statistics.median(torch_s), statistics.median(native_s)
    flops, weight_bytes = 2.0 * m * n * k, 4.0 * n * k
    return {
        "n": n,
        "k": k,
        "m": m,
        "torch_ms": t * 1e3,
        "native_ms": nat * 1e3,
        "speedup": t / nat,
        "torch_gflops": flops / t / 1e9,
        "native_gflops": flops / nat / 1e9,
        "native_weight_gbs": weight_bytes / nat / 1e9,
        "spread_native_ms": [min(native_s) * 1e3, max(native_s) * 1e3],
    }


def roofline(kernel: NativeLinear | None) -> dict:
    """Memory bandwidth (GB/s, a streaming read) and the fp32 matmul peak (GFLOP/s) on this machine."""
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB
    read = _time(big.sum, min_seconds=0.5)
    del big
    m = n = k = 1536
    x, w = torch.randn(m, k), torch.randn(n, k)
    peaks = {"torch": 2.0 * m * n * k / _time(lambda: F.linear(x, w), min_seconds=0.5) / 1e9}
    if kernel is not None:
        packed = kernel.pack(w)
        peaks["native"] = 2.0 * m * n * k / _time(lambda: kernel(x, packed, None, n), min_seconds=0.5) / 1e9
    return {
        "bandwidth_gbs": 4.0 * 256 * 1024 * 1024 / read / 1e9,
        "gemm_gflops": max(peaks.values()),
        "gemm_gflops_by": peaks,
    }


def quantized(args: argparse.Namespace, layers: dict[str, tuple[int, int]]) -> list[dict]:
    names = types(args.quant)
    qk = native_quant.load() if names else None
    if qk is None:
        return []
    print(f"quantized kernel ({'VNNI' if qk.vnni else 'AVX2'}) against weight-only int8 (bf16 activations):")
    print(
        f"{'layer':8} {'N':>6} {'K':>5} {'M':>4} {'type':>5} {'ms':>8} {'int8 ms':>8} {'vs int8':>7} "
        f"{'GMAC/s':>7} {'weights GB/s':>12}"
    )
    out = []
    for name, (n, k) in layers.items():
        for m in (int(r) for r in args.rows.split(",")):
            for q in names:
                r = {"layer": name, **compare_quant(qk, n, k, m, q, args.repeats, _time)}
                out.append(r)
                print(
                    f"{name:8} {n:6d} {k:5d} {m:4d} {r['type']:>5} {r['quant_ms']:8.3f} {r['int8_ms']:8.3f} "
                    f"{r['vs_int8']:6.2f}x {r['gmacs']:7.1f} {r['weight_gbs']:12.1f}"
                )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=BUNDLED_MODEL)
    ap.add_argument("--rows", default="1,16,64,512", help="row counts M, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--quant",
        default="q8_0,q4_1,q5_0,q4_k,q6_k",
        help="quantized types to measure (GGUF block layouts; '' for none)",
    )
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = native.load()
    kernel = NativeLinear(lib) if lib is not None else None
    roof = roofline(kernel)
    print(
        f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads: memory "
        f"{roof['bandwidth_gbs']:.1f} GB/s, fp32 matmul peak {roof['gemm_gflops']:.0f} GFLOP/s "
        f"({', '.join(f'{k} {v:.0f}' for k, v in roof['gemm_gflops_by'].items())})"
    )
    rows: list[dict] = []
    layers, num_layers = shapes(args.model)
    params = linear_params(layers, num_layers)
    if kernel is None:
        print("the native linear kernel did not build here: nothing to compare")
    else:
        print(
            f"{'layer':8} {'N':>6} {'K':>5} {'M':>4} {'torch ms':>9} {'native ms':>9} {'speed-up':>8} "
            f"{'native GFLOP/s':>14} {'weights GB/s':>12}"
        )
        for name, (n, k) in layers.items():
            for m in (int(r) for r in args.rows.split(",")):
                r = {"layer": name, **compare(kernel, n, k, m, args.repeats)}
                rows.append(r)
                print(
                    f"{name:8} {n:6d} {k:5d} {m:4d} {r['torch_ms']:9.3f} {r['native_ms']:9.3f} "
                    f"{r['speedup']:7.2f}x {r['native_gflops']:14.1f} {r['native_weight_gbs']:12.1f}"
                )
    quant_rows = quantized(args, layers)
    if args.json:
        write_json(
            args.json,
            {
                "cpu": cpu_name(),
                "capability": torch.backends.cpu.get_cpu_capability(),
                "threads": args.threads,
                "roofline": roof,
                "shapes": rows,
                "model": args.model,
                "quantized": quant_rows,
                "linear_params": params,
                "panel": kernel.panel if kernel else None,
            },
        )


if __name__ == "__main__":
    main()
