"""What one step hands the model: a ragged batch's tokens and the slots its attention reads.

The engine builds it (`serving.engine.batch.build_batch`); it is defined here, beside the
attention that reads it, so that models never import the engine.  Tokens are flat: first
one token per decoding request, then each extend (prefill) chunk contiguously.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class ExtendSeg:
    start: int  # first flat token index of the chunk
    length: int  # tokens in the chunk
    kv_idx: torch.Tensor  # slots of positions [first, prefix + length); first > 0 only under a sliding window
    prefix: int = 0  # the chunk's first position (its request's positions already computed)
    first: int = 0  # the position of kv_idx[0]: the oldest any query of the chunk sees
    window: int = 0  # the sliding window (0: none)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[length, len(kv_idx)] bool: query i (position prefix+i) sees key j (position first+j) if causal and in
        the window; None when that is plain causal attention from position 0.  Built on first use, once for
        every layer, and only by attention that takes a mask (SDPA; the native kernel reads `window`)."""
        total = self.prefix + self.length
        if self.first == 0 and self.prefix == 0 and (not self.window or self.window >= self.length):
            return None
        q = torch.arange(self.prefix, total)[:, None]
        k = torch.arange(self.first, total)[None, :]
        visible = k <= q
        if self.window:
            visible &= k > q - self.window
        return visible


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] where each token's K/V is written
    num_decode: int  # tokens [0, num_decode) are decode tokens
    decode_kv_idx: torch.Tensor | None  # [B, Lmax] slots (the window's, under a sliding window), padded with PAD_SLOT
    decode_lens: torch.Tensor | None = None  # [B] each decode request's attended length (its first columns)
    # requests the decode rows belong to (0: one each); a speculated request feeds several rows, split as one
    decode_requests: int = 0
    extends: list[ExtendSeg] = field(default_factory=list)
    logits_rows: torch.Tensor | None = None  # flat token indices whose logits are needed
    hidden_rows: torch.Tensor | None = None  # flat token indices whose final hidden states embeddings pool
    hidden: torch.Tensor | None = None  # set by the forward: float32 [len(hidden_rows), hidden] (final norm applied)
    # flat token indices scored for prompt logprobs: the forward leaves their final-normed hidden states in
    # `scored` (the model's dtype) and the engine runs the lm_head over them in row blocks (`CausalLM.head`),
    # so a long chunk never holds [rows, vocab] logits at once
    score_rows: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    # how decode tokens attend: (q [B, H, d], k_pool, v_pool, this batch) -> [B, H, d]
    decode_attention: Callable[..., torch.Tensor] | None = None
    # how each extend chunk attends: (q [n, H, d], k_pool, v_pool, its ExtendSeg) -> [n, H, d]
    extend_attention: Callable[..., torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
