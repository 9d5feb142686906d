"""A radix tree over token ids whose nodes own the KV slots of those tokens (prefix cache).

The idea is SGLang's RadixCache: the K/V of a position depends only on the tokens up to
it, so a request whose prompt starts with tokens the tree holds can point its first
positions at the tree's slots and skip computing them.  Each edge holds a run of token
ids (`key`) and the slots of those positions (`value`); children are indexed by their
first token, so a lookup costs one dict access per node plus a token comparison.

Locks: a running request locks the node its reused prefix ends at, and a lock counts on
every node up to the root (a locked node's ancestors are its prefix).  Locked slots are
in use; unlocked ones are cached and may be evicted, least recently used leaf first.

Pins: a request retracted from the batch pins the node its computed positions end at
(counted up to the root as locks are) until it runs again.  Pinned slots stay evictable
(retraction is there to free KV) but go last: every unpinned leaf is evicted before any
pinned one, so a retracted request usually resumes as a cache hit.  An evicted node keeps
its parent pointer, so unpinning from it still reaches the ancestors left in the tree.
The tree only does bookkeeping: the KV pool frees what `evict`/`reset` return.

Namespaces: a prefix is reused only by requests of the namespace that cached it (a tenant,
a cache salt: `--prefix-cache-sharing`).  The default namespace "" is the root itself; any
other is one node under the root (no tokens, keyed by its name instead of a first token),
so a lookup never leaves its namespace, while eviction still sees one tree: one LRU order
over every namespace's leaves, pins last.  A namespace node left without children is
evicted too.

Evicted prefixes: with an `evicted` log (`serving.engine.prefix_misses.EvictedLog`), every leaf
that eviction or a reset removes is handed to it first (its whole prefix and namespace), so a
later miss can say the prefix had been cached.

KV events: with an `events` recorder (`serving.engine.kv_events.KVEventRecorder`,
`--kv-events-endpoint`), every insertion that adds positions and every evicted leaf is told
to it (the sequence from its namespace's start, where the change starts, the namespace), and
a reset as one clear.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Sequence

import torch

_EMPTY = torch.zeros(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "pin_ref", "last_access", "ns")

    def __init__(
        self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None, ns: str | None = None
    ) -> None:
        self.key = key  # token ids of this edge
        self.value = value  # int64 KV slots of those positions, same length
        self.children: dict[int, TreeNode] = {}  # by first token of the child's key
        self.parent = parent
        self.lock_ref = 0  # running requests whose reused prefix goes through this node
        self.pin_ref = 0  # retracted requests whose computed positions go through this node
        self.last_access = 0  # the tree's clock at the latest match/insert through it (LRU)
        self.ns = ns  # a namespace node's name (no key, no slots; the root's child under that name)

    def __lt__(self, other: TreeNode) -> bool:  # heap order for eviction: unpinned first, then LRU
        return (self.pin_ref > 0, self.last_access) < (other.pin_ref > 0, other.last_access)


def _common_len(key: Sequence[int], ids: Sequence[int], start: int) -> int:
    """How many leading tokens of `key` equal ids[start:]."""
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self) -> None:
        self.root = TreeNode((), _EMPTY, None)  # kept for good: requests with no cached prefix hold it
        self.evicted = None  # an EvictedLog told of every leaf removed (None: nothing told)
        self.events = None  # a KVEventRecorder told of every insertion, eviction and reset (None: nothing told)
        self.total_slots = 0  # slots owned by the tree
        self.locked_slots = 0  # of those, in nodes with lock_ref > 0
        self._clock = 0

    def reset(self) -> torch.Tensor:
        """Drop every node; returns their slots for the caller to free.  No node may be locked."""
        if self.locked_slots:
            raise RuntimeError("radix cache reset while requests hold locks")
        freed = torch.cat([n.value for n in self.nodes()]) if self.total_slots else _EMPTY
        if self.evicted is not None:
            for n in self.nodes():
                if not n.children:
                    self._log_evicted(n)
        if self.events is not None:
            self.events.cleared()
        self.root.children.clear()
        self.total_slots = 0
        return freed

    @property
    def evictable_slots(self) -> int:
        return self.total_slots - self.locked_slots

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookup and insertion -------------------------------------------------
    def _top(self, ns: str, create: bool) -> TreeNode | None:
        """Where namespace `ns` starts: the root for "", else its node (made on first insert)."""
        if not ns:
            return self.root
        top = self.root.children.get(ns)  # type: ignore[call-overload]
        if top is None and create:
            top = self.root.children[ns] = TreeNode((), _EMPTY, self.root, ns=ns)  # type: ignore[index]
        return top

    def match_prefix(self, ids: Sequence[int], ns: str = "") -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `ids` in namespace `ns`: (its slots, the node it ends at).

        A match ending inside a node splits it, so the returned node covers exactly the
        match and locking it protects no more than the caller uses.
        """
        now = self._tick()
        node, i, parts = self._top(ns, create=False) or self.root, 0, []
        if node is not self.root:
            node.last_access = now
            if not ids or ids[0] not in node.children:
                return _EMPTY, self.root  # nothing of it cached: lock nothing, not even the namespace
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            k = _common_len(child.key, ids, i)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            parts.append(child.value)
            node, i = child, i + k
        return (torch.cat(parts) if parts else _EMPTY), node

    def insert(self, ids: Sequence[int], slots: torch.Tensor, ns: str = "") -> int:
        """Make the tree hold `ids` with `slots` in namespace `ns`; returns how many leading positions it
        already had there.

        The tree keeps its own slots for those; the caller frees its copies that differ.
        The new positions' slots are copied, so the caller's table may change afterwards.
        """
        if len(slots) != len(ids):
            raise ValueError("insert needs one slot per token")
        now = self._tick()
        node, i = self._top(ns, create=bool(ids)) or self.root, 0
        node.last_access = now
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = TreeNode(tuple(ids[i:]), slots[i:].clone(), node)
                leaf.last_access = now
                node.children[ids[i]] = leaf
                self.total_slots += len(leaf.key)
                if self.events is not None:
                    self.events.stored(ids, i, ns)
                return i
            k = _common_len(child.key, ids, i)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            node, i = child, i + k
        return i

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child` after its first k tokens; returns the new upper node (same locks)."""
        upper = TreeNode(child.key[:k], child.value[:k], child.parent)
        upper.lock_ref, upper.pin_ref, upper.last_access = child.lock_ref, child.pin_ref, child.last_access
        assert child.parent is not None
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[k:], child.value[k:], upper
        upper.children[child.key[0]] = child
        return upper

    # -- locks --------------------------------------------------------------------
    def path(self, node: TreeNode) -> Iterator[TreeNode]:
        """`node` and its ancestors, the root excluded."""
        while node is not self.root and node is not None:
            yield node
            node = node.parent  # type: ignore[assignment]

    def lock_gain(self, node: TreeNode) -> int:
        """Slots that locking `node` would turn from evictable to locked (admission counts them)."""
        gain = 0
        for n in self.path(node):
            if n.lock_ref:
                break  # its ancestors are locked too
            gain += len(n.value)
        return gain

    def inc_lock(self, node: TreeNode) -> None:
        for n in self.path(node):
            if n.lock_ref == 0:
                self.locked_slots += len(n.value)
            n.lock_ref += 1

    def dec_lock(self, node: TreeNode) -> None:
        for n in self.path(node):
            if n.lock_ref <= 0:
                raise RuntimeError("radix cache unlock without a lock")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.locked_slots -= len(n.value)

    def inc_pin(self, node: TreeNode) -> None:
        for n in self.path(node):
            n.pin_ref += 1

    def dec_pin(self, node: TreeNode) -> None:
        for n in self.path(node):
            if n.pin_ref <= 0:
                raise RuntimeError("radix cache unpin without a pin")
            n.pin_ref -= 1

    # -- eviction -------------------------------------------------------------------
    def evict(self, n: int) -> torch.Tensor:
        """Free at least `n` slots if that many are unlocked: least recently used leaves first,
        a parent becoming a leaf joins the candidates.  Returns the slots freed."""
        heap = [x for x in self.nodes() if not x.children and not x.lock_ref]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while heap and count < n:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            if self.evicted is not None or self.events is not None:
                self._log_evicted(leaf, self.events)
            del parent.children[leaf.key[0] if leaf.ns is None else leaf.ns]  # type: ignore[arg-type]
            freed.append(leaf.value)
            count += len(leaf.value)
            self.total_slots -= len(leaf.value)
            if parent.ns is not None and not parent.children and not parent.lock_ref:
                del self.root.children[parent.ns]  # type: ignore[arg-type]  # an emptied namespace: no slots
            elif parent is not self.root and not parent.children and not parent.lock_ref:
                heapq.heappush(heap, parent)
        return torch.cat(freed) if freed else _EMPTY

    def _log_evicted(self, leaf: TreeNode, events=None) -> None:
        """Tell the log (and `events`) that `leaf`'s positions leave the tree: its prefix from its namespace's
        start."""
        if not leaf.key:
            return  # a namespace node: no positions
        keys, ns = [], ""
        for n in self.path(leaf):
            if n.ns is not None:
                ns = n.ns
            else:
                keys.append(n.key)
        ids = [t for key in reversed(keys) for t in key]
        if self.evicted is not None:
            self.evicted.evicted(ids, len(ids) - len(leaf.key), ns)
        if events is not None:
            events.removed(ids, len(ids) - len(leaf.key), ns)

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
