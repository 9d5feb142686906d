"""The Llama-shaped decoder: pre-norm layers of grouped-query attention and a SwiGLU MLP.

Built from `serving.models.layers` with the weights of a transformers `LlamaForCausalLM`,
and of the families that differ from it only in what the shared layers already take from
the config or the weights: Qwen2 (Q/K/V biases, which `FusedLinear` carries), Mistral (a
sliding window, which the engine's batch metadata applies), Llama-3 RoPE scaling (in
transformers' rotary tables).  Qwen3 adds per-head Q/K norms (`serving.models.qwen3`).
The logits must equal transformers' on the same weights (tests/unit/test_model_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from serving.models.base import ModelDims
from serving.models.layers.attention import SelfAttention
from serving.models.layers.forward_batch import ForwardBatch
from serving.models.layers.kv_cache import KVCache
from serving.models.layers.linear import FusedLinear, Precision
from serving.models.layers.mlp import GatedMLP
from serving.models.layers.norm import NativeNorm, RMSNorm
from serving.models.layers.rope import RotaryTables


def _norm_kernel(p: Precision) -> NativeNorm | None:
    return p.native.norm if p.native is not None else None


@dataclass
class LlamaLayer:
    attn_norm: RMSNorm
    attn: SelfAttention
    mlp_norm: RMSNorm
    mlp: GatedMLP

    @classmethod
    def from_hf(cls, i: int, layer: Any, dims: ModelDims, eps: float, p: Precision,
                qk_norm: bool = False) -> "LlamaLayer":
        a, m, dt, norm = layer.self_attn, layer.mlp, p.torch_dtype, _norm_kernel(p)
        norms = (RMSNorm(a.q_norm.weight.detach().to(dt), eps, norm),
                 RMSNorm(a.k_norm.weight.detach().to(dt), eps, norm)) if qk_norm else (None, None)
        return cls(
            RMSNorm(layer.input_layernorm.weight.detach().to(dt), eps, norm),
            SelfAttention(i, FusedLinear.of(a.q_proj, a.k_proj, a.v_proj, precision=p),
                          FusedLinear.of(a.o_proj, precision=p), dims.num_heads, dims.num_kv_heads, dims.head_dim,
                          *norms, rope_kernel=p.native.rope if p.native is not None else None),
            RMSNorm(layer.post_attention_layernorm.weight.detach().to(dt), eps, norm),
            GatedMLP(FusedLinear.of(m.gate_proj, m.up_proj, precision=p), FusedLinear.of(m.down_proj, precision=p)),
        )

    def __call__(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVCache,
                 fb: ForwardBatch) -> torch.Tensor:
        h, x = self.mlp_norm.add(h, self.attn(self.attn_norm(h), rope, kv, fb))
        return h + self.mlp(x)


@dataclass
class LlamaForward:
    dims: ModelDims
    embed: torch.Tensor
    layers: list[LlamaLayer]
    final_norm: RMSNorm
    lm_head: FusedLinear
    rotary: RotaryTables
    QK_NORM: ClassVar[bool] = False  # per-head RMSNorm on Q and K before RoPE (Qwen3)

    @classmethod
    def from_hf(cls, hf_model: Any, precision: Precision = Precision()) -> "LlamaForward":
        """Take a loaded transformers model's weights (shared, not copied, where the dtype already matches)."""
        cfg, m, dt = hf_model.config, hf_model.model, precision.torch_dtype
        dims = ModelDims.from_hf_config(cfg)
        layers = [LlamaLayer.from_hf(i, layer, dims, cfg.rms_norm_eps, precision, cls.QK_NORM)
                  for i, layer in enumerate(m.layers)]
        return cls(dims, m.embed_tokens.weight.detach().to(dt), layers,
                   RMSNorm(m.norm.weight.detach().to(dt), cfg.rms_norm_eps, _norm_kernel(precision)),
                   FusedLinear.of(hf_model.lm_head, precision=precision),
                   RotaryTables.from_hf(m.rotary_emb, dims.max_positions).to(dt))

    def forward(self, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one ragged batch; returns logits [len(fb.logits_rows), vocab]."""
        h = F.embedding(fb.input_ids, self.embed)
        rope = self.rotary.at(fb.positions)
        for layer in self.layers:
            h = layer(h, rope, kv, fb)
        last = h[fb.logits_rows] if fb.logits_rows is not None else h
        return self.lm_head(self.final_norm(last)).float()
