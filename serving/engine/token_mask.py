"""Grammar token masks as torch ops: llguidance's packed bitmask applied to a batch's logits.

A bitmask row is int32 words: bit b of word w allows token 32·w + b.  It becomes an additive
bias (0.0 where allowed, -inf elsewhere) in one gather: the words read as bytes (little-endian:
token 8·k + j is bit j of byte k) index a [256, 8] table of each byte's eight biases, into a
buffer kept from step to step (`MaskBias`).  Adding the
bias to the masked rows (`index_add_`) leaves their allowed logits exactly as they were.  Measured
on 16 rows of a 49k vocabulary (2 cores): the gather ~0.2 ms, where shift/and into a bool mask and
`masked_fill` take ~3 ms, and `log()` of the 0/1 bits ~4.7 ms.  llguidance's own
`apply_token_bitmask_inplace` is `torch.compile`d (a C compiler at run time, a compile on first use):
not used.

Ids past the tokenizer's vocabulary (a model's logits can be wider) are never allowed.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

_TABLES: dict[torch.dtype, torch.Tensor] = {}


def _table(dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: the bias of bit j of byte value v (0 set, -inf clear)."""
    table = _TABLES.get(dtype)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _TABLES[dtype] = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))
    return table


class MaskBias:
    """`mask_bias` with its buffers kept from step to step: a fresh 3 MB bias a step (16 rows) is page
    faults every time (~50 µs of ~230 µs measured in the engine)."""

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.int32)
        self._out = torch.empty(0, 8)

    def __call__(
        self, bitmask: torch.Tensor, vocab: int, width: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """[n, width] additive bias of bitmask [n, W] (int32, contiguous): 0.0 for the allowed ids below
        `vocab` (the tokenizer's), -inf for every other column of the logits' `width`.  Valid until the next
        call."""
        if sys.byteorder != "little":  # the byte view below reads the words' bits in little-endian order
            raise RuntimeError("token masks assume a little-endian machine")
        n, words = bitmask.shape
        k = n * words * 4
        if self._bytes.numel() < k:
            self._bytes = torch.empty(k, dtype=torch.int32)
        if self._out.shape[0] < k or self._out.dtype != dtype:
            self._out = torch.empty(k, 8, dtype=dtype)
        idx, out = self._bytes[:k], self._out[:k]
        idx.copy_(bitmask.view(torch.uint8).view(-1))
        torch.index_select(_table(dtype), 0, idx, out=out)
        bias = out.view(n, words * 32)
        if vocab < words * 32:
            bias[:, vocab:] = float("-inf")
        if width <= words * 32:
            return bias[:, :width]
        return torch.nn.functional.pad(bias, (0, width - words * 32), value=float("-inf"))


def mask_bias(bitmask: torch.Tensor, vocab: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`MaskBias` without kept buffers: a bias of its own."""
    return MaskBias()(bitmask, vocab, width, dtype)


def apply_bias(logits: torch.Tensor, rows: torch.Tensor | None, bias: torch.Tensor) -> None:
    """In place: logits[rows[j]] += bias[j] (every row, in order, when `rows` is None)."""
    if rows is None:
        logits.add_(bias)
    else:
        logits.index_add_(0, rows, bias)


def allowed_counts(bitmask: torch.Tensor) -> tuple[list[bool], list[bool]]:
    """Per row of bitmask [n, W]: (allows nothing, allows exactly one id), from its words (in numpy: a few
    small arrays, where each torch op would cost more than its work)."""
    words = bitmask.numpy()
    nonzero = np.count_nonzero(words, axis=1).tolist()
    single = [k == 1 and _one_bit(int(words[j][words[j] != 0][0])) for j, k in enumerate(nonzero)]
    return [k == 0 for k in nonzero], single


def _one_bit(word: int) -> bool:
    word &= 0xFFFFFFFF
    return word & (word - 1) == 0
