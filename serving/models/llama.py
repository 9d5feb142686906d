"""Our batched Llama forward (RMSNorm, RoPE, grouped-query attention, SwiGLU) over the paged KV pool.

Weights and config are taken from a transformers `LlamaForCausalLM`; Q/K/V and
gate/up are fused into one matmul each, which is what pays on CPU.  The logits must
equal transformers' own model on the same weights (tests/test_model_equivalence.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.batch import ForwardBatch
from serving.engine.kv_pool import KVPool


@dataclass
class LlamaDims:
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_positions: int


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]).detach()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm so fp32 results agree bit-closely.
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def _gather(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """pool[idx] for a slot-index tensor of any shape; index_select is ~6x faster than advanced indexing on CPU."""
    return pool.index_select(0, idx.reshape(-1)).view(*idx.shape, *pool.shape[1:])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaForward:
    def __init__(self, dims: LlamaDims, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float) -> None:
        self.dims = dims
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        pos = torch.arange(dims.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * rope_scale
        self.sin = emb.sin() * rope_scale

    @classmethod
    def from_hf(cls, hf_model) -> "LlamaForward":
        cfg = hf_model.config
        m = hf_model.model
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dims = LlamaDims(
            vocab_size=cfg.vocab_size,
            hidden=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_eps=cfg.rms_norm_eps,
            max_positions=cfg.max_position_embeddings,
        )
        layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                attn_norm=layer.input_layernorm.weight.detach(),
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous(),
                qkv_bias=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                o=a.o_proj.weight.detach(),
                o_bias=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                mlp_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().contiguous(),
                gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                down=mlp.down_proj.weight.detach(),
                down_bias=None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach(),
            ))
        rotary = m.rotary_emb
        return cls(dims, m.embed_tokens.weight.detach(), layers, m.norm.weight.detach(),
                   hf_model.lm_head.weight.detach(), rotary.inv_freq.detach(), float(rotary.attention_scaling))

    def make_kv_pool(self, num_slots: int, max_requests: int, max_context: int) -> KVPool:
        d = self.dims
        return KVPool(d.num_layers, d.num_kv_heads, d.head_dim, num_slots, max_requests, max_context)

    # -- forward ------------------------------------------------------------
    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run one ragged batch; returns logits [len(fb.logits_rows), vocab]."""
        d = self.dims
        t = fb.num_tokens
        h = F.embedding(fb.input_ids, self.embed)
        cos = self.cos[fb.positions][:, None, :]
        sin = self.sin[fb.positions][:, None, :]
        q_end = d.num_heads * d.head_dim
        k_end = q_end + d.num_kv_heads * d.head_dim
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.attn_norm, d.rms_eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)
            q = qkv[:, :q_end].view(t, d.num_heads, d.head_dim)
            k = qkv[:, q_end:k_end].view(t, d.num_kv_heads, d.head_dim)
            v = qkv[:, k_end:].view(t, d.num_kv_heads, d.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            pool.k[i][fb.out_slots] = k
            pool.v[i][fb.out_slots] = v
            attn = self._attention(q, pool.k[i], pool.v[i], fb)
            h = h + F.linear(attn.reshape(t, q_end), w.o, w.o_bias)
            x = rms_norm(h, w.mlp_norm, d.rms_eps)
            gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        last = h[fb.logits_rows] if fb.logits_rows is not None else h
        return F.linear(rms_norm(last, self.final_norm, d.rms_eps), self.lm_head)

    def _attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = fb.num_decode
        if nd:
            kd = _gather(k_pool, fb.decode_kv_idx).transpose(1, 2)  # [B, kvh, L, d]
            vd = _gather(v_pool, fb.decode_kv_idx).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kd, vd, attn_mask=fb.decode_mask, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for seg in fb.extends:
            sl = slice(seg.start, seg.start + seg.length)
            qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            ks = _gather(k_pool, seg.kv_idx).transpose(0, 1).unsqueeze(0)
            vs = _gather(v_pool, seg.kv_idx).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None,
                                               enable_gqa=True)
            out[sl] = o[0].transpose(0, 1)
        return out
