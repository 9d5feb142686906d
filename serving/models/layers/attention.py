"""Self-attention over the paged KV cache, the same for every family with grouped-query attention.

Each fed token's K/V is written into its slot first; then decode tokens attend as one
batch (`decode_attention`: the native kernel or padded SDPA, as the ForwardBatch says) and
each extend chunk attends on its own, causally, over its prefix's slots plus its own
(`extend_attention`: the native kernel reading the slots in place, or SDPA over a gathered copy).  Heads
are grouped (`enable_gqa=True` / in the kernel), so K/V heads are never repeated in memory.
A sliding window (Mistral) lives in the ForwardBatch: each token's slots and mask reach back
only as far as the window, so nothing here depends on it.

`bidirectional_attention` is the encoders' (BERT): each input runs whole in one step and
attends to all of itself, from this step's K/V alone; nothing is read from or written to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.models.layers.decode_attention import sdpa_decode
from serving.models.layers.extend_attention import sdpa_extend
from serving.models.layers.forward_batch import ForwardBatch
from serving.models.layers.kv_cache import KVCache
from serving.models.layers.linear import FusedLinear
from serving.models.layers.norm import RMSNorm
from serving.models.layers.rope import NativeRope, apply_rotary


def paged_attention(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv: KVCache, layer: int, fb: ForwardBatch
) -> torch.Tensor:
    """Store this step's k, v [T, kv_heads, d] in `layer`'s slots (None: already stored), attend q [T, heads, d];
    returns [T, heads, d]."""
    k_pool, v_pool = kv.k[layer], kv.v[layer]
    if k is not None and v is not None:
        k_pool[fb.out_slots] = k
        v_pool[fb.out_slots] = v
    out = torch.empty_like(q)
    nd = fb.num_decode
    if nd:
        out[:nd] = (fb.decode_attention or sdpa_decode)(q[:nd], k_pool, v_pool, fb)
    for seg in fb.extends:
        sl = slice(seg.start, seg.start + seg.length)
        out[sl] = (fb.extend_attention or sdpa_extend)(q[sl], k_pool, v_pool, seg)
    return out


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """q, k, v [T, heads, d] of whole inputs (the batch's extend chunks, each from position 0); returns
    [T, heads, d], each input's tokens attending to every token of that input and of no other."""
    if fb.num_decode or any(int(fb.positions[seg.start]) != 0 for seg in fb.extends):
        raise ValueError("bidirectional attention runs whole inputs only: no decode tokens, no chunk after the first")
    out = torch.empty_like(q)
    for seg in fb.extends:
        sl = slice(seg.start, seg.start + seg.length)
        out[sl] = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)
        ).transpose(0, 1)
    return out


@dataclass
class SelfAttention:
    """One layer's attention block: fused QKV projection, RoPE on Q and K, paged attention, output projection.

    With `q_norm`/`k_norm` (Qwen3), each head's Q and K are RMS-normalised before RoPE.  With
    `rope_kernel` (float32 on the native kernels) RoPE and the K/V store are one call.
    """

    layer: int  # index of this layer's K/V in the cache
    qkv: FusedLinear  # Q rows, then K, then V
    o: FusedLinear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    rope_kernel: NativeRope | None = None

    def __call__(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVCache, fb: ForwardBatch
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_end = self.num_heads * d
        k_end = q_end + self.num_kv_heads * d
        qkv = self.qkv(x)
        q = qkv[:, :q_end].view(t, self.num_heads, d)
        k = qkv[:, q_end:k_end].view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = qkv[:, k_end:].view(t, self.num_kv_heads, d)
        if self.rope_kernel is not None and q.dtype == torch.float32 and t:
            q = self.rope_kernel(q, k, v, *rope, kv.k[self.layer], kv.v[self.layer], fb.out_slots)
            attn = paged_attention(q, None, None, kv, self.layer, fb)
        else:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            attn = paged_attention(q, k, v, kv, self.layer, fb)
        return self.o(attn.reshape(t, q_end))
