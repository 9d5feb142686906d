"""Linear layers on GGUF-quantized weights, on the native kernel (kernels/quant_linear.cpp).

A weight comes in its GGUF block layout (`QuantWeight`: [rows, bytes per row] uint8, a view of
the file's memory map or quantized at load).  Where this build has an interleaved layout for its
type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K on AVX-512 VNNI: kernels/quant_interleaved.h) `QuantLinear` repacks
it once (`PackedWeight`: the same size, Q4_K a third more for its exact fp32 scales) and the
kernel runs 16 output rows per instruction; otherwise the kernel reads the file's layout as it
is.  Activations are quantized to int8 per 32 values inside the kernel, so every type
runs integer dot products.  `QuantLinear` runs several weights over one input in one call
(fused Q/K/V, gate/up), each in its own type: a GGUF file may mix them (Q4_K_M: Q5_0 Q/K with a
Q8_0 V).  Types the kernel has no decoder for are for the caller to expand (`supports`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Sequence

import gguf
import torch

from serving.models.layers import huge_pages, native

_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
MAX_PARTS = 8


@dataclass
class QuantWeight:
    """One [rows, cols] weight in a ggml block layout; `data` is uint8 [rows, bytes per row]."""

    qtype: gguf.GGMLQuantizationType
    data: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def block(self) -> int:
        """Values per block: the input size must be a multiple of it."""
        return gguf.GGML_QUANT_SIZES[self.qtype][0]


@dataclass
class PackedWeight:
    """A `QuantWeight` repacked for the interleaved kernel: `layout` is the kernel's type id,
    `qtype` the type it came from (the values are the same)."""

    qtype: gguf.GGMLQuantizationType
    layout: int
    data: torch.Tensor
    rows: int
    cols: int


class QuantKernel:
    """The loaded library: matmuls and row lookups on `QuantWeight`s."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._linear = lib.quant_linear
        self._linear.argtypes = [_PTR, _I64, _I64, _INT, _PTR, _PTR, _PTR, _PTR, _I64]
        self._linear.restype = None
        self._rows = lib.quant_dequant_rows
        self._rows.argtypes = [_INT, _PTR, _I64, _PTR, _I64, _PTR]
        self._rows.restype = None
        self._acts = lib.quant_activations
        self._acts.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR]
        self._supported = lib.quant_supported
        self._supported.argtypes = [_INT]
        self._il_layout = lib.quant_il_layout
        self._il_layout.argtypes = [_INT]
        self._il_bytes = lib.quant_il_bytes
        self._il_bytes.argtypes, self._il_bytes.restype = [_INT, _I64, _I64], _I64
        self._il_pack = lib.quant_il_pack
        self._il_pack.argtypes, self._il_pack.restype = [_INT, _PTR, _I64, _I64, _I64, _PTR], None
        self._il_rows = lib.quant_il_rows
        self._il_rows.argtypes, self._il_rows.restype = [_INT, _PTR, _I64, _PTR, _I64, _PTR], None
        self.vnni = bool(lib.quant_vnni())
        self.interleaves = self._il_layout(int(gguf.GGMLQuantizationType.Q8_0)) >= 0  # this build has the layouts

    def supports(self, qtype: gguf.GGMLQuantizationType) -> bool:
        return bool(self._supported(int(qtype)))

    def interleave(self, w: QuantWeight) -> "PackedWeight | None":
        """`w` repacked into this build's VNNI layout (kernels/quant_interleaved.h), or None where
        its type has none here (or the CPU lacks AVX-512 VNNI): the row-major kernel runs it."""
        layout = self._il_layout(int(w.qtype))
        if layout < 0:
            return None
        out = huge_pages.WEIGHTS.bytes(self._il_bytes(int(w.qtype), w.rows, w.cols))  # streamed every step
        self._il_pack(int(w.qtype), w.data.data_ptr(), w.rows, w.cols, w.data.shape[1], out.data_ptr())
        return PackedWeight(w.qtype, layout, out, w.rows, w.cols)

    def matmul(self, x: torch.Tensor, parts: "_Parts") -> torch.Tensor:
        """x [M, K] fp32 contiguous → [M, N]."""
        out = torch.empty((x.shape[0], parts.n), dtype=torch.float32)
        if x.shape[0]:
            self._linear(
                x.data_ptr(),
                x.shape[0],
                x.shape[1],
                parts.count,
                parts.types,
                parts.ptrs,
                parts.rows,
                out.data_ptr(),
                parts.n,
            )
        return out

    def dequant_rows(self, w: QuantWeight | PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of `w` in fp32, shaped [*ids.shape, cols] (embedding lookups)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], w.cols), dtype=torch.float32)
        if flat.shape[0]:
            rows = self._il_rows if isinstance(w, PackedWeight) else self._rows
            rows(_type_id(w), w.data.data_ptr(), w.cols, flat.data_ptr(), flat.shape[0], out.data_ptr())
        return out.view(*ids.shape, w.cols)

    def activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's int8 blocks of x [M, K]: (scale [M, K/32], scale·Σq [M, K/32], q [M, K])."""
        x = x.float().contiguous()
        m, k = x.shape
        d, s = torch.empty(m, k // 32), torch.empty(m, k // 32)
        qs = torch.empty(m, k, dtype=torch.int8)
        self._acts(x.data_ptr(), m, k, d.data_ptr(), s.data_ptr(), qs.data_ptr())
        return d, s, qs


def _type_id(w: QuantWeight | PackedWeight) -> int:
    return w.layout if isinstance(w, PackedWeight) else int(w.qtype)


@dataclass
class _Parts:
    """The ctypes arrays one call passes, built once per layer."""

    weights: Sequence[QuantWeight | PackedWeight]
    count: int = 0
    n: int = 0
    types: ctypes.Array = field(init=False)
    ptrs: ctypes.Array = field(init=False)
    rows: ctypes.Array = field(init=False)

    def __post_init__(self) -> None:
        self.count, self.n = len(self.weights), sum(w.rows for w in self.weights)
        self.types = (ctypes.c_int32 * self.count)(*(_type_id(w) for w in self.weights))
        self.ptrs = (ctypes.c_void_p * self.count)(*(w.data.data_ptr() for w in self.weights))
        self.rows = (ctypes.c_int64 * self.count)(*(w.rows for w in self.weights))


class QuantLinear:
    """y = x · [W_0; W_1; ...]ᵀ (+ bias) for quantized parts sharing their input; y in x's dtype."""

    def __init__(self, kernel: QuantKernel, parts: Sequence[QuantWeight], bias: torch.Tensor | None = None) -> None:
        if not 0 < len(parts) <= MAX_PARTS:
            raise ValueError(f"a quantized linear takes 1 to {MAX_PARTS} weights, not {len(parts)}")
        k = parts[0].cols
        for w in parts:
            if w.cols != k or k % w.block or not kernel.supports(w.qtype) or not w.data.is_contiguous():
                raise ValueError(f"cannot run a {w.qtype.name} [{w.rows}, {w.cols}] weight with input size {k}")
        self.kernel, self.in_features = kernel, k
        self.parts: list[QuantWeight | PackedWeight] = [kernel.interleave(w) or w for w in parts]
        self.bias = None if bias is None else bias.float()
        self._parts = _Parts(self.parts)
        self.out_features = self._parts.n

    @property
    def nbytes(self) -> int:
        return sum(w.data.numel() for w in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        out = self.kernel.matmul(rows, self._parts)
        if self.bias is not None:
            out += self.bias
        out = out.view(*x.shape[:-1], self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


@cache
def load(cache_dir: Path | None = None, march: str | None = None) -> QuantKernel | None:
    """The kernel (built once per machine), or None where it does not build (logged by `native`)."""
    lib = native.load(cache_dir, march)
    return None if lib is None else QuantKernel(lib)
