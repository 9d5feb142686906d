"""Rotary position embedding: cos/sin tables for every position, computed once, applied per layer.

The inverse frequencies and the `attention_scaling` factor come from transformers: the loaded
model's rotary module, or for a model built without it (a GGUF file) `rope_frequencies` — the
default formula its families share, or transformers' own init function of a scaled type (llama3,
yarn, ...) — so rope variants need no code here and no modeling module is imported for them.
`NativeRope` applies the same tables in one call with the K/V store (float32, native kernels).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


def rope_frequencies(config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for `config` as transformers' rotary embedding computes them."""
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if hasattr(config, "to_transformers"):  # a cached `ResolvedConfig`: the init functions call its methods
        config = config.to_transformers()
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq, float(scaling)


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


class NativeRope:
    """The fp32 kernel (kernels/rope.cpp): RoPE on Q and K and the K/V store into the pool, in one call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.rope_store_f32
        self._fn.argtypes = [_PTR, _I64] * 3 + [_PTR] * 6 + [_I64] * 4
        self._fn.restype = None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, H, d], k and v [T, KVH, d] (heads contiguous in each token's row), cos/sin as `RotaryTables.at`
        gives them; writes rope(k) and v into the pools' `slots`, returns rope(q) [T, H, d]."""
        t, h, d = q.shape
        kvh = k.shape[1]
        for x in (q, k, v):
            assert x.stride(2) == 1 and x.stride(1) == d, "heads must be contiguous within a token's row"
        cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype == torch.float32
        assert slots.is_contiguous() and slots.dtype == torch.int64
        out = torch.empty((t, h, d), dtype=torch.float32)
        self._fn(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            out.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            t,
            h,
            kvh,
            d,
        )
        return out
