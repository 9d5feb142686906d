"""Why the prefix cache missed: how much of a request's prompt it matched, and whether the rest had been
cached and evicted or was never seen.

The radix tree forgets what it evicts, so the eviction path (`RadixCache.evict`, and a flush)
hands every removed leaf to an `EvictedLog` first: the prefix the leaf ended, as chained
hashes of whole `BLOCK`-token blocks from the start of the sequence (h0 = hash(namespace),
h(k+1) = hash((h(k), block k))), one hash per block boundary the leaf covered.  The
namespace seeds the chain, so a prefix evicted from one tenant's namespace never explains a
miss of another's.  The log is an insertion-ordered dict of at most `MAX_EVICTED` hashes
(16384: 262,144 evicted prompt positions at 16 per block, about 2 MB); the oldest go first.

At a request's first admission (`PrefixMisses.explain`), when the tree matched fewer than
the positions it could have (every prompt position but the last), the block that ends at the
first boundary past the match decides the reason:

- `evicted`: the log holds its hash: this prefix was cached, then evicted (or flushed);
  `evicted_tokens` counts how far past the match the log still knows it;
- `never_seen`: it does not: never cached in this namespace (or evicted longer ago than the
  log remembers);
- `too_short`: the unmatched rest ends before the next block boundary: the log cannot tell.

A full match is a hit and not counted.  What a miss says stays with operators: the
`prefill` span's attributes and the `sightline_prefix_cache_misses_total{reason}` counter;
it would tell one client about another's prompts, so no response carries it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

from protocol.io_struct import MISS_REASONS, MissCount

BLOCK = 16  # tokens per hashed block
MAX_EVICTED = 16384  # hashes the log keeps (oldest dropped first)


def chain(ids: Sequence[int], ns: str) -> Iterator[int]:
    """The chained hashes of `ids`' whole blocks: h(1), h(2), ... (h(k) ends at position k·BLOCK)."""
    h = hash(ns)
    for b in range(BLOCK, len(ids) + 1, BLOCK):
        h = hash((h, tuple(ids[b - BLOCK : b])))
        yield h


class EvictedLog:
    """The bounded log of evicted prefixes, by the hash of each block boundary they covered."""

    def __init__(self, maxlen: int = MAX_EVICTED) -> None:
        self.maxlen = maxlen
        self.hashes: OrderedDict[int, None] = OrderedDict()

    def evicted(self, ids: Sequence[int], start: int, ns: str) -> None:
        """Positions [start, len(ids)) of the prefix `ids` (namespace `ns`) left the cache."""
        first = start // BLOCK + 1  # the first boundary past `start`
        for k, h in enumerate(chain(ids, ns), 1):
            if k >= first:
                self.hashes[h] = None
                self.hashes.move_to_end(h)
        while len(self.hashes) > self.maxlen:
            self.hashes.popitem(last=False)

    def __contains__(self, h: int) -> bool:
        return h in self.hashes


@dataclass(frozen=True)
class PrefixMiss:
    lookup_tokens: int  # positions the cache could have matched (the prompt but its last)
    matched_tokens: int  # where the match ended
    reason: str  # MISS_REASONS
    evicted_tokens: int = 0  # past the match, positions the log knows were evicted (whole blocks)

    def attributes(self) -> dict[str, str | int]:
        """The `prefill` span's attributes."""
        return {
            "sightline.prefix_cache.lookup_tokens": self.lookup_tokens,
            "sightline.prefix_cache.matched_tokens": self.matched_tokens,
            "sightline.prefix_cache.miss_reason": self.reason,
            "sightline.prefix_cache.evicted_tokens": self.evicted_tokens,
        }


class PrefixMisses:
    """Explains each first admission's miss against the log; counts them by reason."""

    def __init__(self, maxlen: int = MAX_EVICTED) -> None:
        self.log = EvictedLog(maxlen)
        self.counts = dict.fromkeys(MISS_REASONS, 0)

    def explain(self, ids: Sequence[int], matched: int, ns: str) -> PrefixMiss | None:
        """`ids`: the positions looked up; `matched`: how many the tree had.  None for a full match."""
        n = len(ids)
        if matched >= n:
            return None
        first = matched // BLOCK + 1
        if first * BLOCK > n:
            miss = PrefixMiss(n, matched, "too_short")
        else:
            known = 0  # the last boundary past the match that the log holds, contiguously from the first
            for k, h in enumerate(chain(ids, ns), 1):
                if k < first:
                    continue
                if h not in self.log:
                    break
                known = k
            evicted = known * BLOCK - matched if known else 0
            miss = PrefixMiss(n, matched, "evicted" if evicted else "never_seen", evicted)
        self.counts[miss.reason] += 1
        return miss

    def snapshot(self) -> list[MissCount]:
        return [MissCount(reason, n) for reason, n in self.counts.items()]
