"""Linear layers: weights concatenated where inputs are shared (Q/K/V, gate/up: one matmul,
which is what pays on CPU), stored in the precision the server computes in.

`Precision` says how every linear layer of a model computes, the lm_head included:
  - float32: exact (the reference); on the native kernels (`native_ops`: weights repacked
    once into the linear kernel's panel layout) where they build, else torch's matmul;
  - bfloat16: weights and activations in bf16 (fast where the CPU has bf16 matrix units);
  - q8_0, q4_0, q4_1, q5_0, q5_1, q4_k: quantized at load into GGUF's block layout, run on the
    native quantized kernel (`native_quant`) with activations quantized per 32 values: an
    outlier channel (SmolLM2's MLP down-projection input has them) costs precision only
    inside its block.  `gguf`: a GGUF file's weights in their own types (`gguf_weights`);
  - int8: weight-only int8 (symmetric, one scale per output channel) with bfloat16
    activations (`torch._weight_int8pack_mm`): a quarter of float32's weight bytes, and slower
    than the quantized kernel on CPUs without bf16 arithmetic.  Quantizing activations with one
    scale per tensor (fbgemm's dynamic int8 linear) multiplied SmolLM2's perplexity by 2.8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from serving.models.layers.native_linear import NativeLinear
from serving.models.layers.native_quant import QuantKernel, QuantLinear
from serving.models.layers.quantize import quantize_for

if TYPE_CHECKING:
    from serving.models.layers.native_ops import NativeKernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    dtype: str = "float32"  # activations, non-quantized weights and the KV cache
    quantization: str = "none"  # none | int8 | gguf | q8_0 | q4_0 | q4_1 | q5_0 | q5_1 | q4_k
    native: NativeKernels | None = field(default=None, compare=False, repr=False)  # float32 on the native kernels
    quant: QuantKernel | None = field(default=None, compare=False, repr=False)  # quantized weights' kernel

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The fused bias; a part without bias contributes zeros, and no part with one means no bias at all."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]).detach()


def _int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], bf16 scale per output row): w ≈ q * scale, |q| ≤ 127."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scales.to(torch.bfloat16)


@dataclass
class FusedLinear:
    weight: torch.Tensor | None  # [sum of out_features, in_features]: in the compute dtype, or int8; None if packed
    bias: torch.Tensor | None
    scales: torch.Tensor | None = None  # int8 weights: one bf16 scale per output row
    kernel: NativeLinear | None = None  # the native kernel, with the weight in its layout:
    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None
    out_features: int = 0
    quant: QuantLinear | None = None  # quantized weights, on their kernel

    @classmethod
    def of(cls, *linears: torch.nn.Linear, precision: Precision = Precision()) -> "FusedLinear":
        """One linear over the same input as `linears`; its output is theirs concatenated, in order."""
        if len(linears) == 1:  # nothing to fuse: share the model's tensor instead of copying it
            weight = linears[0].weight.detach()
        else:
            weight = torch.cat([lin.weight for lin in linears]).detach().contiguous()
        return cls.from_weight(weight, _cat_bias(*linears), precision)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, precision: Precision) -> "FusedLinear":
        dtype = precision.torch_dtype
        bias = None if bias is None else bias.to(dtype)
        if precision.quantization == "int8":
            q, scales = _int8_weight(weight)
            return cls(q, bias, scales)
        qw = (
            quantize_for(weight, precision.quantization)
            if precision.quant is not None and precision.quantization not in ("none", "gguf")
            else None
        )
        if qw is not None:
            return cls(None, bias, quant=QuantLinear(precision.quant, [qw], bias), out_features=qw.rows)
        k = precision.native.linear if precision.native is not None else None
        if k is not None and dtype == torch.float32:
            n = weight.shape[0]
            return cls(None, bias, kernel=k, packed=k.pack(weight), packed_bias=k.pad_bias(bias, n), out_features=n)
        return cls(weight.to(dtype), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x)
        if self.kernel is not None:
            return self.kernel(x, self.packed, self.packed_bias, self.out_features)
        if self.scales is not None:
            out = torch._weight_int8pack_mm(x, self.weight, self.scales)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)
