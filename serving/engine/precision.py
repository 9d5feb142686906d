"""Which precision the engine computes in: `--dtype` and `--quantization`, with `auto` measured.

`auto` is float32 on the native linear kernel when it builds here (`--linear-backend`): exact,
and faster end to end than torch's bfloat16 where measured, even on a CPU with AVX512-BF16
(docs/engine.md).  Otherwise it times the model's own matmul shape (a 16-token batch through the
fused gate/up projection) in float32 and in bfloat16 with torch and keeps the faster: CPUs
with bf16 matrix units (AMX, AVX512-BF16) run bf16 2-3x faster, CPUs without them
(AVX2 only) run it several times slower than float32.  The numbers go to the log.

`--quantization auto` serves a GGUF file in its own types (as `gguf`, and as llama.cpp does) where
the quantized kernel builds with its interleaved layouts (kernels/quant_interleaved.h: a 512-bit
VNNI tile with AVX-512 VNNI, two 256-bit halves on AVX2), which beat float32 at every batch size
and in prefill (docs/engine.md, "Quantized weights"); where the kernel cannot be built (no g++, no
AVX2/FMA/F16C) a GGUF file is expanded to float32.  A Hugging Face directory stays in its
dtype: nothing is quantized unless asked.  The quantized kernel computes in float32
(activations are quantized inside it), so with it `--dtype auto` is float32 and only what stays
unquantized (norms, the KV cache) follows --dtype.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from serving.args import ServerArgs
from serving.models.base import ModelDims
from serving.models.layers import native_quant
from serving.models.layers.linear import Precision
from serving.models.layers.native_linear import select as select_linear
from serving.models.layers.native_ops import NativeKernels

log = logging.getLogger(__name__)


def _seconds(x: torch.Tensor, w: torch.Tensor, reps: int = 8) -> float:
    with torch.inference_mode():
        F.linear(x, w)  # warm-up: oneDNN picks and caches its kernel
        t0 = time.perf_counter()
        for _ in range(reps):
            F.linear(x, w)
        return (time.perf_counter() - t0) / reps


def measure(dims: ModelDims, rows: int = 16) -> dict[str, float]:
    """Seconds per matmul of `rows` tokens through a [hidden → 4·hidden] weight, per dtype (torch's)."""
    x = torch.randn(rows, dims.hidden)
    w = torch.randn(4 * dims.hidden, dims.hidden)
    return {"float32": _seconds(x, w), "bfloat16": _seconds(x.bfloat16(), w.bfloat16())}


def _quantized(args: ServerArgs, quantization: str) -> tuple[Precision, str]:
    quant = native_quant.load(args.cache_dir_path)
    if quant is None:
        raise RuntimeError(
            f"--quantization {quantization}: the quantized kernel could not be built here (see the "
            "log line above); --quantization none serves the weights expanded"
        )
    dtype = "float32" if args.dtype == "auto" else args.dtype
    kernel, how = select_linear(args.linear_backend, dtype, "none", args.cache_dir_path)
    isa = "VNNI" if quant.vnni else "AVX2"
    native = NativeKernels.of(kernel.lib) if kernel is not None else None
    return (
        Precision(dtype, quantization, native=native, quant=quant),
        f"--quantization {args.quantization}: {quantization} on the native int8 kernel ({isa}), {dtype} "
        f"activations; other weights: {how}",
    )


def _interleaves(args: ServerArgs) -> bool:
    quant = native_quant.load(args.cache_dir_path)
    return quant is not None and quant.interleaves


def choose(args: ServerArgs, dims: ModelDims, gguf: bool = False) -> tuple[Precision, str]:
    """(precision, why) for these flags on this CPU and model (`gguf`: a .gguf file, whose types `auto` keeps)."""
    quantization = args.quantization
    if quantization == "auto":  # see the module docstring: packed where the interleaved kernel runs
        quantization = "gguf" if gguf and _interleaves(args) else "none"
    if quantization == "gguf" and not gguf:
        raise ValueError("--quantization gguf serves a .gguf file's own types: this model is not a GGUF file")
    if quantization == "int8":
        return Precision("bfloat16", "int8"), "--quantization int8 (weight-only; bfloat16 activations)"
    if quantization != "none":
        return _quantized(args, quantization)
    kernel, how = select_linear(
        args.linear_backend, "float32" if args.dtype == "auto" else args.dtype, "none", args.cache_dir_path
    )
    native = NativeKernels.of(kernel.lib) if kernel is not None else None
    if args.dtype != "auto":
        return Precision(args.dtype, native=native), f"--dtype {args.dtype}; linear layers: {how}"
    if native is not None:  # exact, and on the CPUs measured faster end to end than torch's bf16 (docs/engine.md)
        return Precision("float32", native=native), f"--dtype auto: float32, the native linear kernel built ({how})"
    times = measure(dims)
    best = min(times, key=times.get)
    cpu = torch.backends.cpu.get_cpu_capability()
    why = (
        f"--dtype auto on a {cpu} CPU: a [16x{dims.hidden}]x[{dims.hidden}x{4 * dims.hidden}] matmul took "
        + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items())
        + f"; {best} is faster; linear layers: "
        + how
    )
    return Precision(best), why
