"""What the engine needs of any model family: its sizes, a constructor from transformers, one forward;
and the config checks every family shares (what the shared layers can and cannot compute)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from serving.model_files import ModelLoadError
from serving.models.layers.forward_batch import ForwardBatch
from serving.models.layers.kv_cache import KVCache
from serving.models.layers.linear import Precision

# RoPE variants whose cos/sin tables, computed once for every position, are exact.  `dynamic`
# and `longrope` change their frequencies with the sequence length at run time.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class UnsupportedConfig(ModelLoadError):
    """A config field the engine cannot honour: refused at start rather than served wrong."""


def _rope_types(cfg: Any) -> list[str]:
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "rope_type" not in rope and rope and all(isinstance(v, dict) for v in rope.values()):
        return [v.get("rope_type", "default") for v in rope.values()]  # one per layer type
    return [rope.get("rope_type", "default")]


def attention_window(cfg: Any) -> int | None:
    """The sliding window every layer attends within (None: full attention).

    A config that mixes full and sliding-window layers (Qwen2/Qwen3 with `use_sliding_window`
    and `max_window_layers` below the layer count) is refused: the engine keeps one window.
    """
    window = getattr(cfg, "sliding_window", None)
    kinds = set(getattr(cfg, "layer_types", None) or [])
    if not kinds:
        return window or None
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window:
        return int(window)
    sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
    raise UnsupportedConfig(
        f"sliding-window attention on {sliding} of {len(cfg.layer_types)} layers only "
        f"(layer_types {sorted(kinds)}) is not supported: the engine uses one window for "
        "all layers"
    )


def check_config(cfg: Any) -> None:
    """Raise UnsupportedConfig naming the first field the shared layers cannot compute exactly."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfig(f"hidden_act {act!r} is not supported: the gated MLP computes SiLU")
    for rope_type in _rope_types(cfg):
        if rope_type not in STATIC_ROPE:
            raise UnsupportedConfig(
                f"rope_type {rope_type!r} is not supported (its frequencies change with the "
                f"sequence length); supported: {', '.join(STATIC_ROPE)}"
            )
    attention_window(cfg)


@dataclass
class ModelDims:
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    sliding_window: int | None = None  # each token attends to at most this many positions (itself included)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelDims":
        """From the config field names transformers' decoder-only families share."""
        return cls(
            vocab_size=cfg.vocab_size,
            hidden=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            max_positions=cfg.max_position_embeddings,
            sliding_window=attention_window(cfg),
        )


class CausalLM(Protocol):
    """A family's implementation, as the registry returns it and the ModelRunner drives it."""

    dims: ModelDims

    @classmethod
    def from_hf(cls, hf_model: Any, precision: Precision = Precision()) -> "CausalLM":
        """Take the weights of a loaded transformers *ForCausalLM (fp32, eval mode), in `precision`."""
        ...

    @classmethod
    def from_weights(cls, src: Any, precision: Precision = Precision()) -> "CausalLM":
        """Build from a weight source (`serving.models.weights.Weights`: HF model or GGUF file), in `precision`."""
        ...

    def forward(self, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one ragged batch, writing its K/V into `kv`; returns float32 logits [len(fb.logits_rows), vocab].
        An encoder (`serving.models.bert`) writes no K/V and is asked for no logits."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of final-normed hidden states (`fb.scored`, the prompt logprobs' rows)."""
        ...
