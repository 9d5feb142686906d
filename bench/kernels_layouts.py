"""The quantized kernel's layouts per shape, same inputs, same run: interleaved (16 rows per group)
against row-major blocks, beside the native float32 kernel, for each 32-value GGUF type.

    .venv/bin/python -m bench.kernels_layouts [--march haswell] [--m 1,16,128] [--repeats 7]

`--march haswell` builds the kernels for AVX2 alone (no AVX-512, no VNNI): the code path of an
AVX2-only CPU, run on this one.  Medians of `--repeats` calls, ms; the CPU is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.kernels import cpu_name
from serving.models.layers import native, native_quant
from serving.models.layers.native_linear import NativeLinear
from serving.models.layers.native_quant import QuantLinear, _Parts
from serving.models.layers.quantize import quantize_for

SHAPES = ((1536, 576), (576, 1536), (49152, 576))  # SmolLM2's gate/up, down and lm_head [N x K]
TYPES = ("q8_0", "q4_0", "q4_1", "q5_0")


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--march", default=None)
    ap.add_argument("--m", default="1,16,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args(argv)
    lib = native.load(None, a.march)
    quant = native_quant.load(march=a.march)
    if lib is None or quant is None:
        raise SystemExit("the native kernels did not build here")
    native.start_team(lib, a.threads, 50)
    fp32 = NativeLinear(lib)
    print(f"{cpu_name()}, -march={a.march or 'native'}, {a.threads} threads, medians of {a.repeats}\n")
    print("| shape N×K | M | float32 ms | " + " | ".join(f"{t} interleaved / row-major ms" for t in TYPES) + " |")
    print("|---|---:|---:|" + "---:|" * len(TYPES))
    for n, k in SHAPES:
        w = torch.randn(n, k) / k**0.5
        packed = fp32.pack(w)
        weights = {t: quantize_for(w, t) for t in TYPES}
        layers = {t: (QuantLinear(quant, [q]), _Parts([q])) for t, q in weights.items()}
        for m in (int(x) for x in a.m.split(",")):
            x = torch.randn(m, k)
            cells = [f"{median_ms(lambda: fp32(x, packed, None, n), a.repeats):.2f}"]
            for t in TYPES:
                il, row_major = layers[t]
                cells.append(
                    f"{median_ms(lambda: il(x), a.repeats):.2f} / "
                    f"{median_ms(lambda: quant.matmul(x, row_major), a.repeats):.2f}"
                )
            print(f"| {n}×{k} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
