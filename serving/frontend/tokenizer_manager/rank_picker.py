"""Which data-parallel Scheduler rank takes a request: the least loaded, unless a nearly as
idle rank is the one its prompt's opening tokens hash to.

Load is the expected KV tokens (`ServerArgs.expected_tokens`, what --max-inflight-tokens
counts) of this TokenizerManager's own in-flight requests on each rank: known at once,
with no stats to wait for.  With several tokenizer workers each balances its own share,
so the ranks stay balanced overall.  The hash keeps prompts
that open alike (one chat template, one system prompt) on one rank, where the prefix
cache holds them, while that rank is at most one request's worth busier than the least
loaded (SGLang's DP controller routes round-robin or by queue; vLLM's by load alone).
"""

from __future__ import annotations

import zlib
from array import array

AFFINITY_TOKENS = 32  # prompt tokens the affinity hash reads (a shorter prompt goes by load alone)


class RankPicker:
    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.load = [0] * dp_size  # in-flight tokens per rank
        self.routed = [0] * dp_size  # requests sent to each rank (cumulative)
        self.affine = 0  # of those, sent where the prefix hash pointed

    def affinity(self, ids: list[int], namespace: str = "") -> int | None:
        if len(ids) < AFFINITY_TOKENS:
            return None
        return zlib.crc32(namespace.encode() + array("q", ids[:AFFINITY_TOKENS]).tobytes()) % self.dp_size

    def pick(self, ids: list[int], tokens: int, namespace: str = "") -> int:
        """The rank for a request of `tokens` tokens; counts them in its load until `release`.  The prefix
        hash includes the request's prefix-cache namespace: only its own namespace's prefixes can help it."""
        rank = 0
        if self.dp_size > 1:
            least = min(range(self.dp_size), key=self.load.__getitem__)
            pref = self.affinity(ids, namespace)
            rank = pref if pref is not None and self.load[pref] <= self.load[least] + tokens else least
            self.affine += rank == pref
        self.load[rank] += tokens
        self.routed[rank] += 1
        return rank

    def release(self, rank: int, tokens: int) -> None:
        self.load[rank] -= tokens

    def snapshot(self) -> dict:
        return {"in_flight_tokens": list(self.load), "routed": list(self.routed), "affine": self.affine}
