"""Where a model family takes its weights from: a loaded transformers model, or a GGUF file as it is.

A family builds its layers by the Hugging Face names of their modules ("model.layers.0.mlp.down_proj")
and asks the source for each piece in the precision it computes in: `HFWeights` wraps a transformers
model (fp32) and quantizes at load if asked; `serving.models.gguf_weights.GGUFWeights` keeps a
GGUF file's tensors in their own block types.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import torch

from serving.models.layers.embedding import Embedding
from serving.models.layers.linear import FusedLinear, Precision
from serving.models.layers.quantize import AT_LOAD
from serving.models.layers.rope import RotaryTables

HEAD_QUANTIZATION = "q8_0"  # the lm_head (and a tied embedding) of a model quantized at load, as llama.cpp keeps it


class Weights(Protocol):
    config: Any  # the transformers config

    def linear(self, modules: Sequence[str], precision: Precision) -> FusedLinear:
        """One linear over the modules' shared input; outputs concatenated in order."""
        ...

    def vector(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A parameter that is not a linear layer's (a norm's weight, a position table) by its full name."""
        ...

    def has(self, name: str) -> bool:
        """Whether the source holds a parameter of this full name (a checkpoint's naming variant)."""
        ...

    def ignore(self, prefixes: Sequence[str]) -> None:
        """Tensors under these prefixes are known and not computed (BERT's pooler): not refused as unused."""
        ...

    def head(self, precision: Precision) -> tuple[Embedding, FusedLinear]:
        """The token embedding and the lm_head (one quantized table where they are tied)."""
        ...

    def rotary(self, max_positions: int) -> RotaryTables: ...


def embedding_beside(
    table: torch.Tensor, lm_head: FusedLinear, tied: bool, precision: Precision
) -> tuple[Embedding, FusedLinear]:
    """The token embedding and its lm_head: where they are tied and the head is quantized, one
    quantized table serves both (lookups dequantize its rows)."""
    if tied and lm_head.quant is not None:
        return Embedding(None, lm_head.quant.parts[0], precision.quant, precision.torch_dtype), lm_head
    return Embedding(table.detach().to(precision.torch_dtype)), lm_head


def head_precision(precision: Precision) -> Precision:
    """At-load quantization of 4/5-bit types keeps the lm_head at 8 bits."""
    if precision.quantization in AT_LOAD:
        return dataclasses.replace(precision, quantization=HEAD_QUANTIZATION)
    return precision


class HFWeights:
    def __init__(self, hf_model: Any) -> None:
        self.model, self.config = hf_model, hf_model.config

    def linear(self, modules: Sequence[str], precision: Precision) -> FusedLinear:
        return FusedLinear.of(*(self.model.get_submodule(m) for m in modules), precision=precision)

    def vector(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.model.get_parameter(name).detach().to(dtype)

    def has(self, name: str) -> bool:
        try:
            self.model.get_parameter(name)
        except AttributeError:
            return False
        return True

    def ignore(self, prefixes: Sequence[str]) -> None:
        """A loaded model's load report already said what it skipped (`loader._check_weights`)."""

    def head(self, precision: Precision) -> tuple[Embedding, FusedLinear]:
        table = self.model.model.embed_tokens.weight
        lm_head = FusedLinear.of(self.model.lm_head, precision=head_precision(precision))
        return embedding_beside(table, lm_head, self.model.lm_head.weight.data_ptr() == table.data_ptr(), precision)

    def rotary(self, max_positions: int) -> RotaryTables:
        return RotaryTables.from_hf(self.model.model.rotary_emb, max_positions)
