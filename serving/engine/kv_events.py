"""What the prefix cache's changes are as vLLM's KV-cache events: block hashes, stored and removed.

The radix tree holds token runs of any length; a cache-aware router thinks in fixed blocks of
`block_size` tokens from the start of a sequence, each named by a hash chained over the blocks
before it.  A block counts as cached while the tree holds its last position (a tree node implies
its whole prefix), so:

- an insertion that adds positions [start, n) of a sequence stores every block whose end falls
  in (start, n]: one `BlockStored` whose parent is the block before the first of them;
- an eviction of positions [start, n) removes those same blocks: one `BlockRemoved`;
- a reset of the whole tree is one `AllBlocksCleared`.

The hashes are vLLM's `sha256_cbor` in its 64-bit form, as llm-d's KV-cache indexer computes them
from a prompt's tokens (so it can score a prompt against our events): the root is the low 64 bits
of sha256(CBOR(hash_seed)), block k's hash the low 64 bits of sha256(CBOR([parent, tokens, extra]))
with canonical CBOR.  `extra` is None except for the first block of a namespace other than the
shared one, where it is `[namespace]`, as vLLM mixes a request's cache salt into its first block:
one tenant's blocks never share a hash with another's, and the namespace itself is not sent.
Hashes already computed are remembered (by parent and tokens), so a long sequence growing by a few
tokens hashes only its new blocks.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Sequence

from protocol.kv_events import MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

MEMO_LIMIT = 1 << 16  # remembered block hashes before the memo starts over


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form (canonical CBOR, RFC 8949 §4.2.1)."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError("CBOR integer over 64 bits")


def cbor(value: object) -> bytes:
    """Canonical CBOR of what a block hash covers: unsigned ints, text, lists and None."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int) and value >= 0:
        return _cbor_head(0, value)
    if isinstance(value, str):
        raw = value.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, (list, tuple)):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no CBOR form for {type(value).__name__}")


def sha256_64(value: object) -> int:
    """The low 64 bits of sha256(CBOR(value)), big-endian: vLLM's `sha256_cbor` as an int."""
    return int.from_bytes(hashlib.sha256(cbor(value)).digest()[24:], "big")


@lru_cache(maxsize=1 << 18)
def _uint(n: int) -> bytes:
    return _cbor_head(0, n)


def block_hash(parent: int, tokens: Sequence[int], ns: str = "") -> int:
    """`sha256_64([parent, tokens, [ns] or None])`, encoded without the general walk (each block costs this)."""
    extra = cbor([ns]) if ns else b"\xf6"
    body = b"".join([b"\x83", _cbor_head(0, parent), _cbor_head(4, len(tokens)), *map(_uint, tokens), extra])
    return int.from_bytes(hashlib.sha256(body).digest()[24:], "big")


class BlockHasher:
    """The chain of block hashes of a sequence, by block, in one namespace."""

    def __init__(self, block_size: int, seed: str = "") -> None:
        self.block_size = block_size
        self.root = sha256_64(seed)
        self._memo: dict[tuple[int, tuple[int, ...], str], int] = {}

    def chain(self, ids: Sequence[int], ns: str, blocks: int) -> list[int]:
        """Hashes of the first `blocks` whole blocks of `ids`."""
        b, parent, out = self.block_size, self.root, []
        for k in range(blocks):
            tokens = tuple(ids[k * b : (k + 1) * b])
            key = (parent, tokens, ns if k == 0 else "")
            h = self._memo.get(key)
            if h is None:
                if len(self._memo) >= MEMO_LIMIT:
                    self._memo.clear()
                h = self._memo[key] = block_hash(parent, tokens, ns if k == 0 else "")
            out.append(h)
            parent = h
        return out


class KVEventRecorder:
    """Told by the radix tree what it stored, evicted and reset; keeps the events until the Scheduler
    publishes them (`drain`)."""

    def __init__(self, block_size: int = 16, seed: str = "", token_ids: bool = False) -> None:
        self.hasher = BlockHasher(block_size, seed)
        self.token_ids = token_ids
        self.pending: list[KVEvent] = []

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def _blocks(self, start: int, n: int) -> range:
        """Blocks (0-based) whose last position is in [start, n)."""
        b = self.block_size
        return range(start // b, n // b)

    def stored(self, ids: Sequence[int], start: int, ns: str) -> None:
        """Positions [start, len(ids)) of the sequence `ids` (namespace `ns`) entered the cache."""
        blocks = self._blocks(start, len(ids))
        if not blocks:
            return
        hashes = self.hasher.chain(ids, ns, blocks.stop)
        b = self.block_size
        self.pending.append(
            BlockStored(
                block_hashes=hashes[blocks.start :],
                parent_block_hash=hashes[blocks.start - 1] if blocks.start else None,
                token_ids=list(ids[blocks.start * b : blocks.stop * b]) if self.token_ids else [],
                block_size=b,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
                group_idx=0,
            )
        )

    def removed(self, ids: Sequence[int], start: int, ns: str) -> None:
        """Positions [start, len(ids)) of the sequence `ids` (namespace `ns`) left the cache."""
        blocks = self._blocks(start, len(ids))
        if blocks:
            hashes = self.hasher.chain(ids, ns, blocks.stop)
            self.pending.append(BlockRemoved(block_hashes=hashes[blocks.start :], medium=MEDIUM, group_idx=0))

    def cleared(self) -> None:
        """The whole cache was dropped: what was pending about single blocks no longer matters."""
        self.pending = [AllBlocksCleared()]

    def drain(self) -> list[KVEvent]:
        events, self.pending = self.pending, []
        return events
