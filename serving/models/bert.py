"""The BERT encoder (sentence-transformers' all-MiniLM, bge, e5 ...): an embedding model, no LM head.

Absolute learned position embeddings and the token-type embedding of type 0 are added to the
token embedding and LayerNorm'd; each layer is post-LayerNorm with biases: `LN(h + attn(h))`,
then `LN(h + down(GELU(up(h))))`.  Attention is bidirectional, so an input must run whole in one
step and writes no K/V (`layers.attention.bidirectional_attention`; the engine's rules for
encoders are in docs/engine.md, "Embeddings").  The output is the last layer's hidden state
(transformers' `last_hidden_state`, what sentence-transformers pools); the pooler and an MLM
head, if the checkpoint has them, are left unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from serving.models.base import ModelDims, UnsupportedConfig
from serving.models.layers.attention import bidirectional_attention
from serving.models.layers.embedding import Embedding
from serving.models.layers.forward_batch import ForwardBatch
from serving.models.layers.kv_cache import KVCache
from serving.models.layers.linear import FusedLinear, Precision
from serving.models.layers.mlp import GeluMLP
from serving.models.layers.norm import LayerNorm
from serving.models.weights import HFWeights, Weights

GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # hidden_act → F.gelu's approximate
# never computed: BertModel's pooler, BertForMaskedLM's head, the position-ids buffer older checkpoints saved
# (all-MiniLM-L6-v2's has it; transformers skips it too)
UNUSED = ("pooler.", "bert.pooler.", "cls.", "embeddings.position_ids", "bert.embeddings.position_ids")


def check_bert_config(cfg: Any) -> None:
    """Raise UnsupportedConfig naming the first field this encoder does not compute."""
    act = getattr(cfg, "hidden_act", "gelu")
    if act not in GELU:
        raise UnsupportedConfig(f"hidden_act {act!r} is not supported for BERT: {', '.join(GELU)}")
    pos = getattr(cfg, "position_embedding_type", "absolute")
    if pos != "absolute":
        raise UnsupportedConfig(f"position_embedding_type {pos!r} is not supported: absolute only")
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise UnsupportedConfig("a BERT decoder (is_decoder / add_cross_attention) is not supported: encoders only")


def _norm(src: Weights, name: str, eps: float, dt: torch.dtype) -> LayerNorm:
    return LayerNorm(src.vector(name + ".weight", dt), src.vector(name + ".bias", dt), eps)


@dataclass
class BertLayer:
    qkv: FusedLinear  # query rows, then key, then value
    out: FusedLinear
    attn_norm: LayerNorm
    mlp: GeluMLP
    mlp_norm: LayerNorm
    num_heads: int
    head_dim: int

    @classmethod
    def from_weights(cls, pre: str, src: Weights, dims: ModelDims, cfg: Any, p: Precision) -> "BertLayer":
        a, eps, dt = pre + "attention.", cfg.layer_norm_eps, p.torch_dtype
        return cls(
            src.linear([a + "self.query", a + "self.key", a + "self.value"], p),
            src.linear([a + "output.dense"], p),
            _norm(src, a + "output.LayerNorm", eps, dt),
            GeluMLP(
                src.linear([pre + "intermediate.dense"], p),
                src.linear([pre + "output.dense"], p),
                GELU[getattr(cfg, "hidden_act", "gelu")],
            ),
            _norm(src, pre + "output.LayerNorm", eps, dt),
            dims.num_heads,
            dims.head_dim,
        )

    def __call__(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t, width = h.shape[0], self.num_heads * self.head_dim
        q, k, v = (x.reshape(t, self.num_heads, self.head_dim) for x in self.qkv(h).split(width, dim=-1))
        h = self.attn_norm(h + self.out(bidirectional_attention(q, k, v, fb).reshape(t, width)))
        return self.mlp_norm(h + self.mlp(h))


@dataclass
class BertForward:
    """`serving.models.base.CausalLM`'s interface for an encoder: `forward` computes no logits (none are
    asked of it) and leaves the pooled rows' last hidden states in `fb.hidden`."""

    dims: ModelDims
    embed: Embedding
    positions: torch.Tensor  # [max_position_embeddings, hidden]
    token_type: torch.Tensor  # [hidden]: type 0, every token's (single-sentence inputs)
    embed_norm: LayerNorm
    layers: list[BertLayer]

    @classmethod
    def from_hf(cls, hf_model: Any, precision: Precision = Precision()) -> "BertForward":
        """From a loaded transformers `BertModel` (the loader loads encoders with `AutoModel`)."""
        return cls.from_weights(HFWeights(hf_model), precision)

    @classmethod
    def from_weights(cls, src: Weights, precision: Precision = Precision()) -> "BertForward":
        cfg, dt = src.config, precision.torch_dtype
        check_bert_config(cfg)
        heads = cfg.num_attention_heads
        dims = ModelDims(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.num_hidden_layers,
            heads,
            heads,
            cfg.hidden_size // heads,
            cfg.max_position_embeddings,
        )
        # a BertModel's checkpoint names its tensors bare; a BertForMaskedLM's under `bert.`
        pre = "bert." if src.has("bert.embeddings.word_embeddings.weight") else ""
        src.ignore(UNUSED)
        e = pre + "embeddings."
        layers = [
            BertLayer.from_weights(f"{pre}encoder.layer.{i}.", src, dims, cfg, precision)
            for i in range(dims.num_layers)
        ]
        return cls(
            dims,
            Embedding(src.vector(e + "word_embeddings.weight", dt)),
            src.vector(e + "position_embeddings.weight", dt),
            src.vector(e + "token_type_embeddings.weight", dt)[0].clone(),
            _norm(src, e + "LayerNorm", cfg.layer_norm_eps, dt),
            layers,
        )

    def forward(self, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run whole inputs side by side (`kv` is neither read nor written); returns [0, vocab] logits."""
        if fb.logits_rows is not None and fb.logits_rows.numel():
            raise ValueError("an encoder computes no logits: it serves embeddings only")
        h = self.embed_norm(self.embed(fb.input_ids) + self.positions[fb.positions] + self.token_type)
        for layer in self.layers:
            h = layer(h, fb)
        if fb.hidden_rows is not None:  # embedding requests pool these (serving.engine.embedding)
            fb.hidden = h[fb.hidden_rows].float()
        return torch.zeros((0, self.dims.vocab_size), dtype=torch.float32)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("an encoder computes no logits: it serves embeddings only")
