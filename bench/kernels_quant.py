"""Quantized linear layers per shape: the native int8 kernel on each GGUF type against today's
weight-only `int8` (torch's `_weight_int8pack_mm`, bf16 activations), on the same inputs.

Called by `bench.kernels` (`--quant q8_0,q4_1,...`): one row per (shape, M, type) with ms, GMAC/s
and the quantized weight's GB/s.  Types with 256-value blocks are measured only where K allows.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from serving.models.layers.linear import _int8_weight
from serving.models.layers.native_quant import QuantKernel, QuantLinear
from serving.models.layers.quantize import AT_LOAD, FALLBACK, quantize_for


def compare_quant(
    kernel: QuantKernel, n: int, k: int, m: int, name: str, repeats: int, timer: Callable[[Callable[[], object]], float]
) -> dict:
    w, x = torch.randn(n, k) / k**0.5, torch.randn(m, k)
    lin = QuantLinear(kernel, [quantize_for(w, name)])  # the model's K are multiples of 32
    q8, scales = _int8_weight(w)
    xb = x.bfloat16()
    ours, int8 = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            ours.append(timer(lambda: lin(x)))
            int8.append(timer(lambda: torch._weight_int8pack_mm(xb, q8, scales)))
    t, t8 = statistics.median(ours), statistics.median(int8)
    return {
        "n": n,
        "k": k,
        "m": m,
        "type": lin.parts[0].qtype.name,
        "quant_ms": t * 1e3,
        "int8_ms": t8 * 1e3,
        "vs_int8": t8 / t,
        "gmacs": m * n * k / t / 1e9,
        "weight_gbs": lin.nbytes / t / 1e9,
    }


def types(spec: str) -> list[str]:
    names = [s for s in spec.split(",") if s]
    bad = [s for s in names if s not in AT_LOAD]
    if bad:
        raise SystemExit(f"--quant: unknown {', '.join(bad)}; of {', '.join(AT_LOAD)} (fallbacks: {FALLBACK})")
    return names
