"""The gated MLP (SwiGLU): down(SiLU(gate(x)) * up(x)), with gate and up fused into one matmul."""

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
