"""RMSNorm, in transformers' op order so fp32 results agree with it bit-closely; on the native
kernel (kernels/norm.cpp) where the linear layers are native, fused with the residual add before it.
LayerNorm (with its bias: the BERT encoder's) is torch's own, as transformers computes it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm: reordering changes the last bits.  A bf16
    # input is normalised in fp32 and cast back before the weight, as transformers does.
    if x.dtype != torch.float32:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


class NativeNorm:
    """The fp32 kernel: one call for `h = x + residual; y = rms_norm(h)` (or the norm alone)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.rms_norm_f32
        self._fn.argtypes = [_PTR] * 5 + [_I64] * 2 + [ctypes.c_float]
        self._fn.restype = None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(h, y): h = x + residual (None without a residual), y = the norm of h (of x without one)."""
        x = x.contiguous()
        d = x.shape[-1]
        y = torch.empty_like(x)
        h = None
        if residual is not None:
            residual = residual.contiguous()
            h = torch.empty_like(x)
        self._fn(
            x.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            0 if h is None else h.data_ptr(),
            y.data_ptr(),
            x.numel() // d,
            d,
            eps,
        )
        return h, y


@dataclass
class RMSNorm:
    """A norm's weight with its epsilon, so a family's forward does not carry eps around."""

    weight: torch.Tensor
    eps: float
    kernel: NativeNorm | None = None  # fp32 only: set when the model's linear layers are native

    def _native(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and x.dtype == torch.float32 and x.numel() > 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return self.kernel(x, self.weight, self.eps)[1]
        return rms_norm(x, self.weight, self.eps)

    def add(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm): the residual add and the norm that follows it, in one pass when native."""
        if self._native(h):
            out, y = self.kernel(h, self.weight, self.eps, delta)
            return out, y
        h = h + delta
        return h, rms_norm(h, self.weight, self.eps)


@dataclass
class LayerNorm:
    """A LayerNorm's weight and bias with its epsilon (`nn.LayerNorm`'s computation, `F.layer_norm`)."""

    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
