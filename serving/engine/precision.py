"""Which precision the engine computes in: `--dtype` and `--quantization`, with `auto` measured.

`auto` times the model's own matmul shape (a 16-token batch through the fused gate/up
projection) in float32 and in bfloat16 on the CPU it runs on and keeps the faster: CPUs
with bf16 matrix units (AMX, AVX512-BF16) run bf16 2-3x faster, CPUs without them
(AVX2 only) run it several times slower than float32.  The numbers go to the log.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from serving.args import ServerArgs
from serving.models.base import ModelDims
from serving.models.layers.linear import Precision

log = logging.getLogger(__name__)


def _seconds(x: torch.Tensor, w: torch.Tensor, reps: int = 8) -> float:
    with torch.inference_mode():
        F.linear(x, w)  # warm-up: oneDNN picks and caches its kernel
        t0 = time.perf_counter()
        for _ in range(reps):
            F.linear(x, w)
        return (time.perf_counter() - t0) / reps


def measure(dims: ModelDims, rows: int = 16) -> dict[str, float]:
    """Seconds per matmul of `rows` tokens through a [hidden → 4·hidden] weight, per dtype."""
    x = torch.randn(rows, dims.hidden)
    w = torch.randn(4 * dims.hidden, dims.hidden)
    return {"float32": _seconds(x, w), "bfloat16": _seconds(x.bfloat16(), w.bfloat16())}


def choose(args: ServerArgs, dims: ModelDims) -> tuple[Precision, str]:
    """(precision, why) for these flags on this CPU."""
    if args.quantization == "int8":
        return Precision("bfloat16", "int8"), "--quantization int8 (weight-only; bfloat16 activations)"
    if args.dtype != "auto":
        return Precision(args.dtype), f"--dtype {args.dtype}"
    times = measure(dims)
    best = min(times, key=times.get)
    cpu = torch.backends.cpu.get_cpu_capability()
    why = (f"--dtype auto on a {cpu} CPU: a [16x{dims.hidden}]x[{dims.hidden}x{4 * dims.hidden}] matmul took "
           + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()) + f"; {best} is faster")
    return Precision(best), why
