"""A GGUF file's weights as they are: quantized tensors stay in their block types, read in place.

The file is memory-mapped (copy-on-write: nothing is written back) and indexed by `gguf_index`
(its metadata values are skipped, not parsed).  A weight the quantized kernel runs is a view of its
bytes or, where the kernel interleaves rows, a repacked copy, after which the file's pages are
dropped (`release_pages`): resident memory is about the file's size.  Copies are made only where
the layout must change: the Q/K rows of a Llama-arch file, which llama.cpp's converter permuted
into its rotary layout (`unpermute_rows` reverses it, as transformers' reader does), are gathered
back into Hugging Face order, whole rows of blocks at a
time.  Tensors in types the kernel has no decoder for (F16, BF16, Q2_K, Q3_K, IQ*) are expanded to
the compute dtype, with one log line per type; F32 weights run on the float32 linear layers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import gguf
import numpy as np
import torch

from serving.model_files import ModelLoadError
from serving.models.gguf_index import GGUFIndex
from serving.models.layers.embedding import Embedding
from serving.models.layers.linear import FusedLinear, Precision
from serving.models.layers.native_quant import QuantLinear, QuantWeight
from serving.models.layers.rope import RotaryTables, rope_frequencies

log = logging.getLogger(__name__)


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row indices taking llama.cpp's rotary layout (each head's halves interleaved) back to HF order."""
    return torch.arange(n_rows).view(n_head, n_rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


class GGUFWeights:
    """`serving.models.weights.Weights` over a GGUF file; `config` is the corrected HF config of it."""

    def __init__(self, path: Path, config: Any) -> None:
        self.path, self.config = path, config
        try:
            index = GGUFIndex(path)
            self._map, self.arch, tensors = index.mmap, str(index.fields["general.architecture"]), index.tensors
        except (ValueError, KeyError):  # another byte order or version: gguf-py's reader, with all its metadata
            reader = gguf.GGUFReader(path, mode="c")
            self._map = getattr(reader.data, "_mmap", None)  # numpy's memmap keeps the mmap object here
            self.arch, tensors = str(reader.fields["general.architecture"].contents()), reader.tensors
        self.tensors = {t.name: t for t in tensors}
        arch_id = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.arch), None)
        if arch_id is None:
            raise ModelLoadError(f"GGUF architecture {self.arch!r} has no tensor name map in gguf-py")
        self.names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
        self.expanded: dict[str, int] = {}  # type name -> tensors expanded

    # -- tensors by HF name -------------------------------------------------------------------
    def _tensor(self, hf_name: str) -> Any:
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        t = self.tensors.get(name) if name else None
        if t is None:
            raise ModelLoadError(f"GGUF file {self.path.name} has no tensor for {hf_name} ({name})")
        return t

    def _has(self, hf_name: str) -> bool:
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return name is not None and name in self.tensors

    def _row_order(self, hf_name: str, n_rows: int) -> torch.Tensor | None:
        if self.arch != "llama":
            return None
        cfg = self.config
        if ".q_proj." in hf_name:
            return unpermute_rows(n_rows, cfg.num_attention_heads)
        if ".k_proj." in hf_name:
            return unpermute_rows(n_rows, cfg.num_key_value_heads or cfg.num_attention_heads)
        return None

    def _rows(self, hf_name: str, t: Any) -> torch.Tensor:
        """The tensor's rows (uint8 blocks, or float values), in HF order: a view unless reordered."""
        data = torch.from_numpy(np.asarray(t.data))
        order = self._row_order(hf_name, data.shape[0])
        return data[order].contiguous() if order is not None else data

    def _float(self, hf_name: str, t: Any) -> torch.Tensor:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            self.expanded[t.tensor_type.name] = self.expanded.get(t.tensor_type.name, 0) + 1
        values = torch.from_numpy(np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32))
        order = self._row_order(hf_name, values.shape[0])
        return values[order].contiguous() if order is not None else values

    def _quant(self, hf_name: str, t: Any, precision: Precision) -> QuantWeight | None:
        if precision.quant is None or not precision.quant.supports(t.tensor_type):
            return None
        return QuantWeight(t.tensor_type, self._rows(hf_name, t), int(t.shape[0]))

    # -- the Weights protocol -----------------------------------------------------------------
    def linear(self, modules: Sequence[str], precision: Precision) -> FusedLinear:
        weights = [self._tensor(m + ".weight") for m in modules]
        biases = [
            self._float(m + ".bias", self._tensor(m + ".bias")) if self._has(m + ".bias") else None for m in modules
        ]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(int(w.shape[1])) for b, w in zip(biases, weights)])
        parts = [self._quant(m + ".weight", w, precision) for m, w in zip(modules, weights)]
        if all(p is not None for p in parts):
            lin = QuantLinear(precision.quant, parts, bias)
            return FusedLinear(None, None, quant=lin, out_features=lin.out_features)
        full = torch.cat([self._float(m + ".weight", w) for m, w in zip(modules, weights)])
        return FusedLinear.from_weight(full, bias, precision)

    def vector(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self._float(name, self._tensor(name)).to(dtype)

    def has(self, name: str) -> bool:
        return self._has(name)

    def ignore(self, prefixes: Sequence[str]) -> None:
        """Nothing to do: a GGUF file's tensors are never checked for unused ones."""

    def head(self, precision: Precision) -> tuple[Embedding, FusedLinear]:
        table = self._tensor("model.embed_tokens.weight")
        quant = self._quant("model.embed_tokens.weight", table, precision)
        embed = (
            Embedding(None, quant, precision.quant, precision.torch_dtype)
            if quant is not None
            else Embedding(self._float("model.embed_tokens.weight", table).to(precision.torch_dtype))
        )
        head = "lm_head" if self._has("lm_head.weight") else "model.embed_tokens"
        return embed, self.linear([head], precision)

    def rotary(self, max_positions: int) -> RotaryTables:
        return RotaryTables.build(*rope_frequencies(self.config), max_positions)

    def release_pages(self) -> None:
        """Drop the file's resident pages once the model is built.

        Interleaved layouts are copies, so after repacking the mapped bytes are needed only where a
        tensor is still a view of them (a tied embedding's row lookups, row-major types); those pages
        fault back in from the page cache as they are read.  Nothing was written to the private
        mapping, so dropping its pages loses nothing.
        """
        if self._map is not None and hasattr(self._map, "madvise"):
            import mmap

            self._map.madvise(mmap.MADV_DONTNEED)

    def log_expanded(self) -> None:
        for name, n in sorted(self.expanded.items()):
            log.info(
                "GGUF %s: %d %s tensors expanded to the compute dtype (no native kernel for %s)",
                self.path.name,
                n,
                name,
                name,
            )
