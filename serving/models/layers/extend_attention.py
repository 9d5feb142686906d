"""Extend attention: a prefill chunk's query tokens against its prefix's slots and its own, causally.

Two implementations, the same choice as decode attention (`--attention-backend`, made once in
`decode_attention.select`): where the decode kernel is native, so is this one.
  - `native`: a C++ kernel (kernels/extend_attention.cpp) that reads the chunk's K/V rows in place
    through its slot list, a block of query tokens per task sharing each row read, each row's
    softmax over its own causal (and window) range: no gathered copy, no mask tensor;
  - `sdpa`: gather the chunk's whole context from the pool and run torch's
    scaled_dot_product_attention with the chunk's mask (plain causal from position 0).
Both agree to float rounding; the tests compare them.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
import torch.nn.functional as F

from serving.models.layers.decode_attention import DecodeAttention, NativeDecode, bind_by_dtype, gather
from serving.models.layers.forward_batch import ExtendSeg

# (q [n, H, d] of the chunk, k_pool, v_pool, its segment) -> [n, H, d]
ExtendAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExtendSeg], torch.Tensor]


def sdpa_extend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seg: ExtendSeg) -> torch.Tensor:
    """q [n, H, d] → [n, H, d], over a gathered copy of the chunk's context and its mask."""
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
    ks = gather(k_pool, seg.kv_idx).transpose(0, 1).unsqueeze(0)
    vs = gather(v_pool, seg.kv_idx).transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None, enable_gqa=True)
    return o[0].transpose(0, 1)


class NativeExtend:
    """The C++ kernel behind the ExtendAttention signature."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = bind_by_dtype(lib, "extend_attention", 5, 6)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seg: ExtendSeg) -> torch.Tensor:
        n, h, d = q.shape
        qf = q.contiguous().float()
        out = torch.empty((n, h, d), dtype=torch.float32)
        idx = seg.kv_idx
        assert idx.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()
        self._fns[k_pool.dtype](
            qf.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            idx.data_ptr(),
            out.data_ptr(),
            n,
            idx.shape[0],
            h,
            k_pool.shape[1],
            d,
            seg.window,
            d**-0.5,
        )
        return out.to(q.dtype)


def extend_for(decode: DecodeAttention) -> ExtendAttention:
    """The extend attention that goes with `decode` (as `decode_attention.select` chose it): native beside
    the native decode kernel, its library the same; else SDPA."""
    return NativeExtend(decode.lib) if isinstance(decode, NativeDecode) else sdpa_extend
