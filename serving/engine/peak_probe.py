"""The machine's own peak, measured once at the Scheduler's start: what its steps' FLOPs and bytes are held against.

A datasheet peak says little about a container's share of a CPU, so the engine measures what its
own threads reach (torch's intra-op threads, the count the model runs on): a float32 GEMM for
compute and a copy of a buffer well past the caches for bandwidth, each repeated for a short
budget and its best run kept (the least disturbed by neighbours).  About 100-200 ms in all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

GEMM_N = 512  # square float32 GEMM: 2·N³ FLOPs a run, small enough to run a few times in the budget
COPY_BYTES = 64 << 20  # past most L3s: the copy streams from and to memory
BUDGET_S = 0.05  # per measurement; at least MIN_RUNS runs whatever it takes
MIN_RUNS = 3


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s
    bytes_per_second: float  # bytes read + written per second


def _best(run: Callable[[], object], budget_s: float) -> float:
    """The fastest of repeated runs of `run` (seconds), after one untimed warm-up."""
    run()
    best, runs, deadline = float("inf"), 0, time.perf_counter() + budget_s
    while runs < MIN_RUNS or time.perf_counter() < deadline:
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
        runs += 1
    return max(best, 1e-9)


def measure(budget_s: float = BUDGET_S, gemm_n: int = GEMM_N, copy_bytes: int = COPY_BYTES) -> Peak:
    """Peak FLOP/s (a float32 GEMM) and bytes/s (a memory copy: each byte read once and written once)."""
    with torch.inference_mode():
        a, b = torch.randn(gemm_n, gemm_n), torch.randn(gemm_n, gemm_n)
        out = torch.empty(gemm_n, gemm_n)
        gemm = _best(lambda: torch.mm(a, b, out=out), budget_s)
        src = torch.ones(copy_bytes // 4)
        dst = torch.empty_like(src)
        copy = _best(lambda: dst.copy_(src), budget_s)
    return Peak(2.0 * gemm_n**3 / gemm, 2.0 * copy_bytes / copy)
