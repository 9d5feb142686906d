"""Which KV slots each request holds: the pool and the prefix cache seen from the engine's requests.

As mini-sglang's `CacheManager` (nano-vllm's `BlockManager`): the admission policy decides
who runs (`serving.engine.admission`); this unit does what running, finishing and being
retracted mean for KV, so `SchedulerCore` never touches a slot itself.

A running request's row points at: positions [0, tree_len) in the prefix cache, locked
(`tree_node`); positions [tree_len, num_computed) private to it.  Every prefill chunk is
handed to the cache (`give_to_tree`) so a request arriving next reuses it.  Finishing
leaves every computed position in the cache, unlocked; retraction does too, and pins it
(`RadixCache.inc_pin`: evicted after every unpinned entry) until the request runs again.
Without the prefix cache, finishing and retraction free the request's slots.  Every lookup
and insertion stays in the request's namespace (`Req.namespace`), so no request reuses a
prefix another namespace computed.

At a request's first admission a partial match is explained (`prefix_misses`: where the match
ended, and whether the rest had been cached and evicted) against the log of what the tree
evicted; `Req.prefix_miss` keeps it for its `prefill` span.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.engine.kv_pool import KVPool
from serving.engine.prefix_misses import PrefixMisses
from serving.engine.radix_cache import RadixCache, TreeNode
from serving.engine.request import Req

_EMPTY = torch.zeros(0, dtype=torch.int64)


@dataclass
class Match:
    """The longest cached prefix of a waiting request's positions to compute."""

    slots: torch.Tensor
    node: TreeNode | None
    gain: int  # cached slots that locking it would turn from evictable to in use
    held: int = -1  # positions the cache holds, more than `slots` when prompt logprobs must be scored (-1: as slots)

    @property
    def length(self) -> int:
        return len(self.slots)


class CacheManager:
    def __init__(self, pool: KVPool, tree: RadixCache | None) -> None:
        self.pool = pool
        self.tree = tree
        pool.tree = tree
        self.misses = PrefixMisses() if tree is not None else None
        if tree is not None and self.misses is not None:
            tree.evicted = self.misses.log

    @property
    def available(self) -> int:
        """Slots this step may still allocate (free, or cached and evictable)."""
        return self.pool.available

    def match(self, req: Req) -> Match:
        """What the cache holds of `req`'s positions to compute, all but the last (its logits give the next token).

        A request whose prompt logprobs are not all scored reuses no position from its first unscored one on
        (`Req.score_from`): their logits must be computed, so a first admission recomputes its whole prompt
        (and still fills the cache), and a resumed one only what it had not scored."""
        if self.tree is None or req.pooling is not None and req.pooling.mode != "last":
            return Match(_EMPTY, None, 0)  # mean and cls pooling read every (the first) position's hidden state
        slots, node = self.tree.match_prefix(req.seq[: req.prefill_len - 1], req.namespace)
        held, limit = len(slots), req.score_from
        if limit is not None and held > limit:
            slots, node = self.tree.match_prefix(req.seq[:limit], req.namespace)
        return Match(slots, node, self.tree.lock_gain(node), held)

    def attach(self, req: Req, match: Match) -> None:
        """Give an admitted request a row pointing at its cached prefix, locked; a retracted one's pin goes."""
        m = match.length
        if req.times.scheduled is None:  # its first admission: what the cache held, used or not
            req.prompt_cache_held = max(m, match.held)
            if self.misses is not None:
                req.prefix_miss = self.misses.explain(
                    req.seq[: req.prefill_len - 1], req.prompt_cache_held, req.namespace
                )
        req.row = self.pool.admit(req.prefill_len - m + match.gain)
        if self.tree is not None and match.node is not None:
            self.tree.inc_lock(match.node)
            self.pool.req_to_token[req.row, :m] = match.slots
            req.tree_node, req.tree_len = match.node, m
        req.num_computed = m
        self.unpin(req)

    def unpin(self, req: Req) -> None:
        if req.pinned is not None:
            assert self.tree is not None
            self.tree.dec_pin(req.pinned)
            req.pinned = None

    def give_to_tree(self, req: Req, keep_lock: bool) -> None:
        """Hand the request's positions [tree_len, num_computed) to the prefix cache.

        Positions the tree already had (another request computed the same prefix) keep the
        tree's slots and the request's copies are freed.  With `keep_lock` (the request
        runs on) its row is re-pointed at the tree's slots and it locks the longer prefix.
        """
        tree, pool, n = self.tree, self.pool, req.num_computed
        assert tree is not None
        if n <= req.tree_len:
            return
        ids = req.seq[:n]
        row = pool.req_to_token[req.row]
        present = tree.insert(ids, row[:n], req.namespace)
        if present < req.tree_len:
            raise RuntimeError("prefix cache lost a locked prefix (accounting bug)")
        if present > req.tree_len:
            pool.free(row[req.tree_len : present].clone())
        if keep_lock:
            slots, node = tree.match_prefix(ids, req.namespace)
            tree.inc_lock(node)
            if req.tree_node is not None:
                tree.dec_lock(req.tree_node)
            req.tree_node = node
            row[:n] = slots
        req.tree_len = n

    def release(self, req: Req, cache: bool) -> None:
        """The request ended: its computed positions go to the cache (if `cache` and there is one), the rest is
        freed, its row too.  A failed step's request may have left bad K/V behind: the engine passes cache=False."""
        self.unpin(req)
        if req.row < 0:
            return
        if req.num_computed > req.total_len:  # ended inside a speculative run: K/V of tokens it never emitted
            self.pool.free(self.pool.req_to_token[req.row, req.total_len : req.num_computed].clone())
            req.num_computed = req.total_len
        start = 0
        if self.tree is not None:
            if cache:
                self.give_to_tree(req, keep_lock=False)
            if req.tree_node is not None:
                self.tree.dec_lock(req.tree_node)
            start = req.tree_len  # positions before it are the tree's
        self.pool.release(req.row, req.num_computed, start=start)
        req.row, req.tree_node = -1, None  # its counts stay, for its telemetry

    def retract(self, req: Req) -> int:
        """Take a running request's KV from it; returns how many of its positions the cache keeps (pinned)."""
        kept, tree = 0, self.tree
        if tree is not None:
            self.give_to_tree(req, keep_lock=False)
            kept = req.num_computed
            if kept:
                _, node = tree.match_prefix(req.seq[:kept], req.namespace)
                tree.inc_pin(node)
                req.pinned = node
            if req.tree_node is not None:
                tree.dec_lock(req.tree_node)
        self.pool.release(req.row, req.num_computed, start=req.tree_len)
        req.row, req.tree_node, req.tree_len, req.num_computed = -1, None, 0, 0
        return kept

    def flush(self) -> None:
        """Free every unlocked cached slot (all of the cache when nothing runs), pinned ones included."""
        self.pool.flush_tree()
