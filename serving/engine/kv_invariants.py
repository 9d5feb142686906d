"""The KV bookkeeping's invariants, checked between steps by the tests (and on demand).

Every slot 1..capacity is exactly one of: free, owned by the prefix cache, or private to
one running request; reservations and prefix locks add up; a running request can always
get its next slot.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from serving.engine.kv_pool import KVPool
    from serving.engine.request import Req


def check_kv_invariants(pool: KVPool, running: Collection[Req], waiting: Collection[Req]) -> None:
    """Raise AssertionError unless the KV bookkeeping is consistent (call between steps).

    Every slot 1..capacity is exactly one of: free, owned by the prefix cache, or
    private to one running request (its positions [tree_len, num_computed)).  The
    pool's reservation is the sum of the running requests', none of which holds more
    private slots than it reserved, and capacity >= reserved + locked tree slots: so a
    running request always finds its next slot, evicting unlocked cache if need be.
    Each tree node's lock count is the number of running requests reusing it, and a
    request's first tree_len positions point at its locked prefix's slots.  It takes the
    pool (and its prefix cache, `pool.tree`) and the engine's queues, not the engine.
    """
    tree = pool.tree
    free = pool.free_slot_list()
    owner: dict[int, str] = {}

    def claim(slots: list[int], who: str) -> None:
        for s in slots:
            assert 1 <= s <= pool.capacity, f"{who} holds slot {s}, outside 1..{pool.capacity}"
            assert s not in owner, f"slot {s} is both {owner[s]} and {who}"
            owner[s] = who

    claim(free, "free")
    locks: dict[int, int] = {}
    if tree is not None:
        nodes = list(tree.nodes())
        for node in nodes:
            assert node.key and len(node.key) == len(node.value), "tree node with an empty or mismatched key"
            assert node.parent is not None and node.parent.children.get(node.key[0]) is node, "tree link broken"
            claim(node.value.tolist(), "tree")
        assert tree.total_slots == sum(len(n.value) for n in nodes), "tree total_slots is off"
        assert tree.locked_slots == sum(len(n.value) for n in nodes if n.lock_ref > 0), "tree locked_slots is off"
    rows = set()
    for req in running:
        assert req.row >= 0 and req.row not in rows, f"{req.rid}: bad or shared row {req.row}"
        rows.add(req.row)
        assert req.tree_len <= req.num_computed <= req.total_len, f"{req.rid}: tree_len/num_computed out of order"
        table = pool.req_to_token[req.row]
        private = req.num_computed - req.tree_len
        assert private <= req.reserved, f"{req.rid}: {private} private slots exceed its reservation {req.reserved}"
        claim(table[req.tree_len:req.num_computed].tolist(), f"private to {req.rid}")
        if tree is None:
            assert req.tree_len == 0 and req.tree_node is None, f"{req.rid}: tree state without a tree"
            continue
        assert req.tree_node is not None, f"{req.rid}: running without a tree node"
        path = list(tree.path(req.tree_node))
        assert sum(len(n.value) for n in path) == req.tree_len, f"{req.rid}: locked prefix length != tree_len"
        prefix = torch.cat([n.value for n in reversed(path)]) if path else table[:0]
        assert torch.equal(table[:req.tree_len], prefix), f"{req.rid}: row does not point at its tree prefix"
        if path:
            assert path[-1].parent is tree.root, f"{req.rid}: its tree node is detached"
        for n in path:
            locks[id(n)] = locks.get(id(n), 0) + 1
    for req in waiting:
        assert req.row == -1 and req.tree_node is None, f"waiting {req.rid} holds KV"
    if tree is not None:
        for node in tree.nodes():
            assert node.lock_ref == locks.get(id(node), 0), (
                f"tree node lock_ref {node.lock_ref} != {locks.get(id(node), 0)} running requests using it")
    assert len(owner) == pool.capacity, f"{pool.capacity - len(owner)} slots are neither free, cached nor owned"
    assert pool.reserved == sum(r.reserved for r in running), (
        f"pool reserved {pool.reserved} != running requests' {sum(r.reserved for r in running)}")
    assert pool.capacity >= pool.reserved + pool.locked_slots, (
        f"capacity {pool.capacity} < reserved {pool.reserved} + locked {pool.locked_slots}")
    assert pool.free_rows + len(running) == pool.max_requests, "request rows leaked"
