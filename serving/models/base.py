"""What the engine needs of any model family: its sizes, a constructor from transformers, one forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from serving.models.layers.forward_batch import ForwardBatch
from serving.models.layers.kv_cache import KVCache
from serving.models.layers.linear import Precision


@dataclass
class ModelDims:
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelDims":
        """From the config field names transformers' decoder-only families share."""
        return cls(
            vocab_size=cfg.vocab_size,
            hidden=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            max_positions=cfg.max_position_embeddings,
        )


class CausalLM(Protocol):
    """A family's implementation, as the registry returns it and the ModelRunner drives it."""

    dims: ModelDims

    @classmethod
    def from_hf(cls, hf_model: Any, precision: Precision = Precision()) -> "CausalLM":
        """Take the weights of a loaded transformers *ForCausalLM (fp32, eval mode), in `precision`."""
        ...

    def forward(self, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one ragged batch, writing its K/V into `kv`; returns float32 logits [len(fb.logits_rows), vocab]."""
        ...
