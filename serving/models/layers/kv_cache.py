"""The KV storage attention reads and writes: per layer, a K and a V tensor of token slots.

Which slot holds which position of which request is the engine's bookkeeping
(`serving.engine.kv_pool` hands slots out); a model writes the slots a batch names and
reads the slots it lists, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.models.layers import huge_pages

PAD_SLOT = 0  # a zeroed slot never handed out: padded attention reads land here


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer, [num_slots + 1, num_kv_heads, head_dim]
    v: list[torch.Tensor]

    @classmethod
    def zeros(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, dtype: torch.dtype = torch.float32
    ) -> "KVCache":
        """`num_slots` usable slots plus PAD_SLOT."""
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # one buffer on huge pages (a decode step reads slots all over it), so the 2 MiB rounding
        # is paid once, not per layer
        pools = huge_pages.empty((2, num_layers, *shape), dtype).zero_()
        return cls(list(pools[0].unbind(0)), list(pools[1].unbind(0)))
