"""fp32 linear layers on the native kernel (kernels/linear.cpp): torch's BLAS is the alternative.

The weight is repacked once, at load, into the kernel's panel layout ([N/P][K][P], zero
padded; P = the kernel's panel width, 32 columns with AVX-512 or AVX2 alike), and the
bias padded to whole panels; the unpacked weight is then no longer needed by the layer.  Packed
weights lie on huge pages (huge_pages.py), as the kernel streams them.
The kernel runs every M (a decode batch, a prefill chunk) in one call on the kernels' thread
team (native.py).  `--linear-backend auto` takes it for float32 whenever it builds here (g++, AVX2
and FMA at least); `bench.kernels` measures it against torch per shape.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from serving.models.layers import huge_pages, native

BACKENDS = ("auto", "native", "torch")
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class NativeLinear:
    """The loaded kernel: `pack` a weight once, then call it on fp32 activations."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib  # the kernels library (its other kernels: the fused norm)
        self._fn = lib.linear_f32
        self._fn.argtypes = [_PTR] * 4 + [_I64] * 3
        self._fn.restype = None
        lib.linear_f32_panel.restype = ctypes.c_int
        self.panel = int(lib.linear_f32_panel())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] fp32 → the panel layout [ceil(N/P), K, P], zero padded."""
        n, k = weight.shape
        padded = -(-n // self.panel) * self.panel
        w = torch.zeros(padded, k, dtype=torch.float32)
        w[:n] = weight.detach().float()
        out = huge_pages.WEIGHTS.tensor((padded // self.panel, k, self.panel), torch.float32)
        return out.copy_(w.view(padded // self.panel, self.panel, k).transpose(1, 2))

    def pad_bias(self, bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if bias is None:
            return None
        b = torch.zeros(-(-n // self.panel) * self.panel, dtype=torch.float32)
        b[:n] = bias.detach().float()
        return b

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """x [..., K] → [..., N] in fp32."""
        k = packed.shape[1]
        rows = x.reshape(-1, k)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        out = torch.empty((rows.shape[0], n), dtype=torch.float32)
        if rows.shape[0]:
            self._fn(
                rows.data_ptr(),
                packed.data_ptr(),
                0 if bias is None else bias.data_ptr(),
                out.data_ptr(),
                rows.shape[0],
                n,
                k,
            )
        return out.view(*x.shape[:-1], n)


def select(
    backend: str, dtype: str, quantization: str, cache_dir: Path | None = None
) -> tuple[NativeLinear | None, str]:
    """The kernel for `--linear-backend` (None: torch's matmul) and a line saying why, for the log."""
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return None, "torch (asked for)"
    if dtype != "float32" or quantization != "none":
        if backend == "native":
            raise RuntimeError(
                "--linear-backend native computes in float32: use it with --dtype float32 and no --quantization"
            )
        return (
            None,
            f"torch (auto: the native kernel is float32 only; computing in {dtype}, quantization {quantization})",
        )
    lib = native.load(cache_dir)
    if lib is not None and lib.linear_f32_panel() > 0:
        kernel = NativeLinear(lib)
        return kernel, f"native kernel, {kernel.panel}-column panels ({'asked for' if backend == 'native' else 'auto'})"
    if backend == "native":
        raise RuntimeError("--linear-backend native: the kernel could not be built here (see the log line above)")
    return None, "torch (auto: the native kernel did not build)"
