"""Rotary position embedding: cos/sin tables for every position, computed once, applied per layer.

The inverse frequencies and the `attention_scaling` factor come from transformers' rotary
module of the loaded model, so its rope variants (llama3, yarn, ...) need no code here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RotaryTables:
    cos: torch.Tensor  # [max_positions, head_dim], already times attention_scaling
    sin: torch.Tensor

    @classmethod
    def build(cls, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int) -> "RotaryTables":
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return cls(emb.cos() * attention_scaling, emb.sin() * attention_scaling)

    @classmethod
    def from_hf(cls, rotary_emb: Any, max_positions: int) -> "RotaryTables":
        """From a transformers `*RotaryEmbedding` module (its `inv_freq` buffer and `attention_scaling`)."""
        return cls.build(rotary_emb.inv_freq.detach(), float(rotary_emb.attention_scaling), max_positions)

    def to(self, dtype: torch.dtype) -> "RotaryTables":
        """Tables in the dtype the model computes in (computed in fp32 first, then rounded once)."""
        return RotaryTables(self.cos.to(dtype), self.sin.to(dtype))

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of each token's position, [T, 1, head_dim]: broadcast over the heads of [T, heads, head_dim]."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin
