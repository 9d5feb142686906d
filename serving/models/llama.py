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

from serving.models.base import ModelDims
from serving.models.layers.attention import SelfAttention
from serving.models.layers.decode_stack import DecodeStack
from serving.models.layers.embedding import Embedding
from serving.models.layers.forward_batch import ForwardBatch
from serving.models.layers.kv_cache import KVCache
from serving.models.layers.linear import FusedLinear, Precision
from serving.models.layers.mlp import GatedMLP
from serving.models.layers.norm import NativeNorm, RMSNorm
from serving.models.layers.rope import RotaryTables
from serving.models.weights import HFWeights, Weights


def _norm_kernel(p: Precision) -> NativeNorm | None:
    return p.native.norm if p.native is not None else None


@dataclass
class LlamaLayer:
    attn_norm: RMSNorm
    attn: SelfAttention
    mlp_norm: RMSNorm
    mlp: GatedMLP

    @classmethod
    def from_weights(
        cls, i: int, src: Weights, dims: ModelDims, eps: float, p: Precision, qk_norm: bool = False
    ) -> "LlamaLayer":
        pre, dt, norm = f"model.layers.{i}.", p.torch_dtype, _norm_kernel(p)
        a, m = pre + "self_attn.", pre + "mlp."
        norms = (
            (
                RMSNorm(src.vector(a + "q_norm.weight", dt), eps, norm),
                RMSNorm(src.vector(a + "k_norm.weight", dt), eps, norm),
            )
            if qk_norm
            else (None, None)
        )
        return cls(
            RMSNorm(src.vector(pre + "input_layernorm.weight", dt), eps, norm),
            SelfAttention(
                i,
                src.linear([a + "q_proj", a + "k_proj", a + "v_proj"], p),
                src.linear([a + "o_proj"], p),
                dims.num_heads,
                dims.num_kv_heads,
                dims.head_dim,
                *norms,
                rope_kernel=p.native.rope if p.native is not None else None,
            ),
            RMSNorm(src.vector(pre + "post_attention_layernorm.weight", dt), eps, norm),
            GatedMLP(
                src.linear([m + "gate_proj", m + "up_proj"], p),
                src.linear([m + "down_proj"], p),
                p.native.silu_mul if p.native is not None else None,
            ),
        )

    def __call__(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVCache, fb: ForwardBatch
    ) -> torch.Tensor:
        h, x = self.mlp_norm.add(h, self.attn(self.attn_norm(h), rope, kv, fb))
        return h + self.mlp(x)


@dataclass
class LlamaForward:
    dims: ModelDims
    embed: Embedding
    layers: list[LlamaLayer]
    final_norm: RMSNorm
    lm_head: FusedLinear
    rotary: RotaryTables
    stack: DecodeStack | None = None  # decode-only steps in one native call (None: layer by layer)
    QK_NORM: ClassVar[bool] = False  # per-head RMSNorm on Q and K before RoPE (Qwen3)

    @classmethod
    def from_hf(cls, hf_model: Any, precision: Precision = Precision()) -> "LlamaForward":
        """Take a loaded transformers model's weights (shared, not copied, where the dtype already matches)."""
        return cls.from_weights(HFWeights(hf_model), precision)

    @classmethod
    def from_weights(cls, src: Weights, precision: Precision = Precision()) -> "LlamaForward":
        cfg, dt = src.config, precision.torch_dtype
        dims = ModelDims.from_hf_config(cfg)
        layers = [
            LlamaLayer.from_weights(i, src, dims, cfg.rms_norm_eps, precision, cls.QK_NORM)
            for i in range(dims.num_layers)
        ]
        embed, lm_head = src.head(precision)
        rotary = src.rotary(dims.max_positions).to(dt)
        stack = (
            DecodeStack.build(precision.native.linear.lib, layers, rotary, dims.hidden)
            if precision.native is not None
            else None
        )
        return cls(
            dims,
            embed,
            layers,
            RMSNorm(src.vector("model.norm.weight", dt), cfg.rms_norm_eps, _norm_kernel(precision)),
            lm_head,
            rotary,
            stack,
        )

    def forward(self, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one ragged batch; returns logits [len(fb.logits_rows), vocab]."""
        h = self.embed(fb.input_ids)
        if self.stack is not None and self.stack.runs(fb, kv):
            h = self.stack(h, self.rotary, kv, fb)
        else:
            rope = self.rotary.at(fb.positions)
            for layer in self.layers:
                h = layer(h, rope, kv, fb)
        if fb.hidden_rows is not None:  # embedding requests pool these (serving.engine.embedding)
            fb.hidden = self.final_norm(h[fb.hidden_rows]).float()
        if fb.score_rows is not None:  # prompt logprobs: the engine runs `head` over these in row blocks
            fb.scored = self.final_norm(h[fb.score_rows])
        last = h[fb.logits_rows] if fb.logits_rows is not None else h
        return self.head(self.final_norm(last))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of final-normed hidden states (the forward's `fb.scored` rows)."""
        return self.lm_head(hidden).float()
