"""The paged KV cache's bookkeeping: which slots are free, and a request→slot table.

As in SGLang's `token_to_kv_pool` / `req_to_token_pool`: a token's K and V live in one
slot of each layer's storage (`serving.models.layers.kv_cache.KVCache`, which the model
reads and writes), anywhere in it; `req_to_token[row, pos]` says which slot holds
position `pos` of the request in `row`.  So requests of any length join and leave the
batch without copying, and freeing a request returns its slots at once.

Admission uses *reservation*: a request is admitted only if its worst case
(prompt + max_new_tokens) fits in the slots not yet promised to others.  Slots are
handed out lazily as tokens are written, but a running request can never run out, so
nothing is ever retracted or recomputed (see docs/engine.md for why).
"""

from __future__ import annotations

import torch

from serving.models.layers.kv_cache import KVCache


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_requests: int,
        max_context: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_slots < 1 or max_requests < 1 or max_context < 2:
            raise ValueError("KV pool needs at least one slot, one request row and a context of 2")
        self.kv = KVCache.zeros(num_layers, num_kv_heads, head_dim, num_slots, dtype)
        self.req_to_token = torch.zeros((max_requests, max_context), dtype=torch.int64)
        self.capacity = num_slots
        self.max_requests = max_requests
        self.max_context = max_context
        # Stacks (pop from the end): low slot numbers are handed out first; PAD_SLOT (0) never is.
        self._free_slots: list[int] = list(range(num_slots, 0, -1))
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        self.reserved = 0

    # -- accounting -------------------------------------------------------
    @property
    def used_slots(self) -> int:
        return self.capacity - len(self._free_slots)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def can_reserve(self, n: int) -> bool:
        return self.reserved + n <= self.capacity and bool(self._free_rows)

    def is_empty(self) -> bool:
        return self.used_slots == 0 and self.reserved == 0 and self.free_rows == self.max_requests

    # -- per request ------------------------------------------------------
    def admit(self, reserve: int) -> int:
        """Promise `reserve` slots to a new request and give it a table row."""
        if not self.can_reserve(reserve):
            raise RuntimeError("KV pool admission without room (caller must check can_reserve)")
        self.reserved += reserve
        return self._free_rows.pop()

    def extend(self, row: int, start: int, n: int) -> torch.Tensor:
        """Allocate slots for positions [start, start+n) of `row`; returns them."""
        if n > len(self._free_slots):
            raise RuntimeError("KV pool exhausted despite reservation (accounting bug)")
        slots = self._free_slots[len(self._free_slots) - n :]
        del self._free_slots[len(self._free_slots) - n :]
        t = torch.tensor(slots, dtype=torch.int64)
        self.req_to_token[row, start : start + n] = t
        return t

    def unextend(self, slots: torch.Tensor) -> None:
        """Hand back slots `extend` gave out for positions a failed step never marked computed."""
        self._free_slots.extend(slots.tolist())

    def release(self, row: int, num_tokens: int, reserved: int) -> None:
        """Return a request's slots, its reservation and its row."""
        if num_tokens:
            self._free_slots.extend(self.req_to_token[row, :num_tokens].tolist())
        self.reserved -= reserved
        self._free_rows.append(row)

    def slots_of(self, row: int, length: int) -> torch.Tensor:
        return self.req_to_token[row, :length]
