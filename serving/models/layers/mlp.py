"""The gated MLP (SwiGLU): down(SiLU(gate(x)) * up(x)), with gate and up fused into one matmul;
and the plain GELU MLP of BERT encoders: down(GELU(up(x)))."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.models.layers.linear import FusedLinear


@dataclass
class GatedMLP:
    gate_up: FusedLinear  # gate rows first, then up rows
    down: FusedLinear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


@dataclass
class GeluMLP:
    up: FusedLinear  # BERT's `intermediate.dense`
    down: FusedLinear  # BERT's `output.dense`
    approximate: str = "none"  # "tanh" for hidden_act gelu_new / gelu_pytorch_tanh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))
