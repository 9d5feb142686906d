"""The gated MLP (SwiGLU): down(SiLU(gate(x)) * up(x)), with gate and up fused into one matmul;
and the plain GELU MLP of BERT encoders: down(GELU(up(x)))."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.models.layers.activation import NativeSiluMul
from serving.models.layers.linear import FusedLinear


@dataclass
class GatedMLP:
    gate_up: FusedLinear  # gate rows first, then up rows
    down: FusedLinear
    act: NativeSiluMul | None = None  # float32 on the native kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        if self.act is not None and gu.dtype == torch.float32 and gu.dim() == 2 and gu.shape[0]:
            return self.down(self.act(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


@dataclass
class GeluMLP:
    up: FusedLinear  # BERT's `intermediate.dense`
    down: FusedLinear  # BERT's `output.dense`
    approximate: str = "none"  # "tanh" for hidden_act gelu_new / gelu_pytorch_tanh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))
