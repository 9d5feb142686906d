"""A Hugging Face directory's safetensors read straight into the engine's layers.

Building the forward from the files (memory-mapped by safetensors) skips transformers' model
classes: their import alone (modeling_utils, torch.distributed, dynamo) is most of a Scheduler's
start-up, and the weights are read once instead of copied into an nn.Module first.  Tensors are
taken by their Hugging Face names, as `HFWeights` takes them from a loaded model, and converted
to float32 as transformers' loader would.  Every tensor of the files must be used and every
tensor asked for must exist: a checkpoint that does not match the architecture is refused with
the names, as the transformers path refuses it (`loader._check_weights`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open

from serving.model_files import ModelLoadError, one_line
from serving.models.layers.embedding import Embedding
from serving.models.layers.linear import FusedLinear, Precision
from serving.models.layers.rope import RotaryTables, rope_frequencies
from serving.models.weights import embedding_beside, head_precision

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def weight_files(path: Path) -> list[Path]:
    """The directory's safetensors files (one, or the shards its index lists); [] when it has none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


class SafetensorsWeights:
    """`serving.models.weights.Weights` over a directory's safetensors; `finish` checks nothing was left."""

    def __init__(self, path: Path, config: Any) -> None:
        self.path, self.config = path, config
        self._where: dict[str, Any] = {}
        try:
            for f in weight_files(path):
                handle = safe_open(str(f), framework="pt")
                for name in handle.keys():
                    self._where[name] = handle
        except Exception as exc:
            raise ModelLoadError(f"cannot load model from {path}: {one_line(exc)}") from exc
        self._used: set[str] = set()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # a tied checkpoint may store the table under either name (ours stores it once, as lm_head)
        self._table = EMBED if EMBED in self._where or not tied else LM_HEAD
        self._head = self._table if tied else LM_HEAD

    def _need(self, name: str) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is None:
            self._refuse("missing keys", [name])
        self._used.add(name)
        try:
            return handle.get_tensor(name).float()
        except Exception as exc:
            raise ModelLoadError(f"cannot load model from {self.path}: {one_line(exc)}") from exc

    def _refuse(self, kind: str, names: list[str]) -> None:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ModelLoadError(
            f"weights in {self.path} do not match the architecture: {kind} {', '.join(names[:3])}{more}"
        )

    def finish(self) -> None:
        """Refuse the checkpoint if one of its tensors was never used (transformers would ignore it)."""
        unused = sorted(set(self._where) - self._used - ({LM_HEAD} if self._head != LM_HEAD else set()))
        if unused:
            self._refuse("unexpected keys", unused)

    # -- the Weights protocol -----------------------------------------------------------------
    def linear(self, modules: Sequence[str], precision: Precision) -> FusedLinear:
        weights = [self._need(m + ".weight") for m in modules]
        biases = [self._need(m + ".bias") if m + ".bias" in self._where else None for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(w.shape[0]) for b, w in zip(biases, weights)])
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return FusedLinear.from_weight(weight.contiguous(), bias, precision)

    def vector(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self._need(name).to(dtype)

    def has(self, name: str) -> bool:
        return name in self._where

    def ignore(self, prefixes: Sequence[str]) -> None:
        self._used.update(n for n in self._where if n.startswith(tuple(prefixes)))

    def head(self, precision: Precision) -> tuple[Embedding, FusedLinear]:
        table = self._need(self._table)
        head_weight = table if self._head == self._table else self._need(self._head)
        lm_head = FusedLinear.from_weight(head_weight.contiguous(), None, head_precision(precision))
        return embedding_beside(table, lm_head, self._head == self._table, precision)

    def rotary(self, max_positions: int) -> RotaryTables:
        return RotaryTables.build(*rope_frequencies(self.config), max_positions)
