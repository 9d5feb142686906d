"""The token embedding: a table in the compute dtype, or rows dequantized from a quantized one.

A quantized table is the tied lm_head's weight (a GGUF file's `token_embd`, or an HF model's
embedding quantized at load for its tied lm_head): one copy serves both, and a lookup
dequantizes only the rows of the batch's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.models.layers.native_quant import PackedWeight, QuantKernel, QuantWeight


@dataclass
class Embedding:
    table: torch.Tensor | None  # [vocab, hidden] in the compute dtype; None when quantized
    quant: QuantWeight | PackedWeight | None = None
    kernel: QuantKernel | None = None
    dtype: torch.dtype = torch.float32

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        rows = self.kernel.dequant_rows(self.quant, ids)
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)
