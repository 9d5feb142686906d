"""The gated MLP's activation on the native kernel (kernels/activation.cpp)."""

from __future__ import annotations

import ctypes

import torch

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class NativeSiluMul:
    """The fp32 kernel (kernels/activation.cpp): SiLU(gate)·up straight from the fused projection's rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.silu_mul_f32
        self._fn.argtypes = [_PTR, _PTR, _I64, _I64]
        self._fn.restype = None

    def __call__(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [M, 2N] (gate columns, then up) → [M, N]."""
        gu = gu.contiguous()
        m, n = gu.shape[0], gu.shape[1] // 2
        out = torch.empty((m, n), dtype=torch.float32)
        self._fn(gu.data_ptr(), out.data_ptr(), m, n)
        return out
