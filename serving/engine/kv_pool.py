"""The paged KV cache's bookkeeping: which slots are free, and a request→slot table.

As in SGLang's `token_to_kv_pool` / `req_to_token_pool`: a token's K and V live in one
slot of each layer's storage (`serving.models.layers.kv_cache.KVCache`, which the model
reads and writes), anywhere in it; `req_to_token[row, pos]` says which slot holds
position `pos` of the request in `row`.  So requests of any length join and leave the
batch without copying, and freeing a request returns its slots at once.

With the prefix cache (`tree`, a `RadixCache`), a slot is free, owned by the tree, or
private to one running request.  Tree slots locked by running requests are in use;
unlocked ones are cached and count as free on demand: `extend` evicts them, least
recently used first (retracted requests' pinned ones last), when the free stack is short.
`available` (free + evictable) is what a step may still allocate.  The pool promises
nothing: who may allocate how much is the admission policy's (`serving.engine.admission`),
and which request owns which slot is the cache manager's (`serving.engine.cache_manager`).
"""

from __future__ import annotations

import torch

from serving.engine.radix_cache import RadixCache
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
        self.tree: RadixCache | None = None  # the prefix cache, when enabled
        self.evicted_slots = 0  # cumulative: tree slots evicted to make room

    # -- accounting -------------------------------------------------------
    @property
    def used_slots(self) -> int:
        """Slots holding K/V: private to running requests or owned by the prefix cache."""
        return self.capacity - len(self._free_slots)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def tree_slots(self) -> int:
        return self.tree.total_slots if self.tree else 0

    @property
    def locked_slots(self) -> int:
        """Tree slots some running request reuses: in use, not evictable."""
        return self.tree.locked_slots if self.tree else 0

    @property
    def evictable_slots(self) -> int:
        """Tree slots no running request locks: cached, freed on demand."""
        return self.tree.evictable_slots if self.tree else 0

    @property
    def available(self) -> int:
        """Slots a step may allocate: free, or cached and evictable."""
        return len(self._free_slots) + self.evictable_slots

    @property
    def in_use(self) -> int:
        """Slots running requests hold: their private ones and the cached prefixes they lock."""
        return self.capacity - self.available

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def stats(self) -> dict[str, int]:
        """The pool's part of `SchedulerStats`, by field name (sent after every step)."""
        return {"kv_used": self.used_slots, "kv_in_use": self.in_use, "kv_total": self.capacity}

    def is_empty(self) -> bool:
        """No slot holds K/V (prefix cache included), every row free."""
        return self.used_slots == 0 and self.free_rows == self.max_requests

    def is_idle(self) -> bool:
        """Nothing belongs to a request: every used slot is unlocked prefix cache."""
        return self.free_rows == self.max_requests and self.locked_slots == 0 and self.used_slots == self.tree_slots

    # -- per request ------------------------------------------------------
    def admit(self, need: int = 0) -> int:
        """A table row for a new request about to allocate `need` slots (which must be available)."""
        if need > self.available or not self._free_rows:
            raise RuntimeError("KV pool admission without room (the admission policy must check first)")
        return self._free_rows.pop()

    def extend(self, row: int, start: int, n: int) -> torch.Tensor:
        """Allocate slots for positions [start, start+n) of `row`; returns them.

        Evicts unlocked prefix-cache slots when the free stack is short.
        """
        t = self._take(n)
        self.req_to_token[row, start : start + n] = t
        return t

    def extend_each(self, rows: list[int], positions: list[int]) -> torch.Tensor:
        """One slot for position `positions[i]` of `rows[i]`, for every i: a decode step's allocation,
        written into the slot table at once; returns them."""
        t = self._take(len(rows))
        self.req_to_token[torch.tensor(rows, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)] = t
        return t

    def _take(self, n: int) -> torch.Tensor:
        """n free slots, evicting unlocked prefix-cache slots when the free stack is short."""
        if n > len(self._free_slots) and self.tree is not None:
            freed = self.tree.evict(n - len(self._free_slots))
            self.evicted_slots += len(freed)
            self._free_slots.extend(freed.tolist())
        if n > len(self._free_slots):
            raise RuntimeError("KV pool exhausted: the step allocated more than was available (scheduling bug)")
        slots = self._free_slots[len(self._free_slots) - n :]
        del self._free_slots[len(self._free_slots) - n :]
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        """Return slots no one owns any more: those `extend` gave out for positions a failed step
        never marked computed, or a request's copies of positions the prefix cache already had."""
        self._free_slots.extend(slots.tolist())

    def release(self, row: int, num_tokens: int, start: int = 0) -> None:
        """Return a request's private slots (positions [start, num_tokens)) and its row."""
        if num_tokens > start:
            self._free_slots.extend(self.req_to_token[row, start:num_tokens].tolist())
        self._free_rows.append(row)

    def flush_tree(self) -> int:
        """Free every unlocked prefix-cache slot (all of the tree when nothing is locked); returns how many."""
        if self.tree is None:
            return 0
        freed = self.tree.reset() if not self.tree.locked_slots else self.tree.evict(self.tree.evictable_slots)
        self._free_slots.extend(freed.tolist())
        return len(freed)

    def slots_of(self, row: int, length: int) -> torch.Tensor:
        return self.req_to_token[row, :length]

    def free_slot_list(self) -> list[int]:
        """A copy of the free stack (invariant checks)."""
        return list(self._free_slots)
