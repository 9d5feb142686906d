"""The native float32 path as one bundle: the linear layers and the small ops around them, all from
the one kernels library (native.py), so a model either runs all of them or none."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from serving.models.layers.activation import NativeSiluMul
from serving.models.layers.native_linear import NativeLinear
from serving.models.layers.norm import NativeNorm
from serving.models.layers.rope import NativeRope


@dataclass(frozen=True)
class NativeKernels:
    linear: NativeLinear  # every linear layer, the lm_head included (weights repacked at load)
    norm: NativeNorm  # RMSNorm, fused with the residual add before it
    rope: NativeRope  # RoPE on Q and K, fused with the K/V store
    silu_mul: NativeSiluMul  # the gated MLP's activation

    @classmethod
    def of(cls, lib: ctypes.CDLL) -> "NativeKernels":
        return cls(NativeLinear(lib), NativeNorm(lib), NativeRope(lib), NativeSiluMul(lib))
