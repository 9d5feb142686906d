"""Which precision the engine computes in: `--dtype` and `--quantization`, with `auto` measured.

`auto` times the model's own matmul shape (a 16-token batch through the fused gate/up
projection) in float32 (on the native linear kernel when it builds: `--linear-backend`) and in
bfloat16 on the CPU it runs on and keeps the faster: CPUs
with bf16 matrix units (AMX, AVX512-BF16) run bf16 2-3x faster, CPUs without them
(AVX2 only) run it several times slower than float32.  The numbers go to the log.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

from serving.args import ServerArgs
from serving.models.base import ModelDims
from serving.models.layers.linear import Precision
from serving.models.layers.native_linear import NativeLinear
from serving.models.layers.native_linear import select as select_linear

log = logging.getLogger(__name__)


def _seconds(x: torch.Tensor, w: torch.Tensor, linear: Callable = F.linear, reps: int = 8) -> float:
    with torch.inference_mode():
        linear(x, w)  # warm-up: oneDNN picks and caches its kernel
        t0 = time.perf_counter()
        for _ in range(reps):
            linear(x, w)
        return (time.perf_counter() - t0) / reps


def measure(dims: ModelDims, rows: int = 16, kernel: NativeLinear | None = None) -> dict[str, float]:
    """Seconds per matmul of `rows` tokens through a [hidden → 4·hidden] weight, per dtype (float32 on
    the native kernel when there is one, as the model would run it)."""
    x = torch.randn(rows, dims.hidden)
    w = torch.randn(4 * dims.hidden, dims.hidden)
    if kernel is not None:
        packed, n = kernel.pack(w), w.shape[0]
        fp32 = _seconds(x, packed, lambda a, b: kernel(a, b, None, n))
    else:
        fp32 = _seconds(x, w)
    return {"float32": fp32, "bfloat16": _seconds(x.bfloat16(), w.bfloat16())}


def choose(args: ServerArgs, dims: ModelDims) -> tuple[Precision, str]:
    """(precision, why) for these flags on this CPU; the linear kernel is picked for float32 only."""
    if args.quantization == "int8":
        return Precision("bfloat16", "int8"), "--quantization int8 (weight-only; bfloat16 activations)"
    kernel, how = select_linear(args.linear_backend, "float32" if args.dtype == "auto" else args.dtype,
                                args.quantization, args.cache_dir_path)
    if args.dtype != "auto":
        return Precision(args.dtype, kernel=kernel), f"--dtype {args.dtype}; linear layers: {how}"
    times = measure(dims, kernel=kernel)
    best = min(times, key=times.get)
    cpu = torch.backends.cpu.get_cpu_capability()
    why = (f"--dtype auto on a {cpu} CPU: a [16x{dims.hidden}]x[{dims.hidden}x{4 * dims.hidden}] matmul took "
           + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()) + f"; {best} is faster"
           + (f"; linear layers: {how}" if best == "float32" else ""))
    return Precision(best, kernel=kernel if best == "float32" else None), why
