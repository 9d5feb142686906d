"""The KV bookkeeping's invariants, checked after every step by the tests (and on demand).

Every slot 1..capacity is exactly one of: free, owned by the prefix cache, or private to
one running request; prefix locks count the running requests reusing each node and pins
the retracted ones waiting to resume; a waiting request holds no slot.  Under
`--admission reserve`, the running requests' worst cases also fit in what is available;
under `estimate` nothing is promised between steps (the next step retracts if need be).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from serving.engine.admission import AdmissionPolicy
    from serving.engine.kv_pool import KVPool
    from serving.engine.radix_cache import RadixCache, TreeNode
    from serving.engine.request import Req


def check_kv_invariants(
    pool: KVPool, running: Collection[Req], waiting: Collection[Req], policy: AdmissionPolicy | None = None
) -> None:
    """Raise AssertionError unless the KV bookkeeping is consistent (call between steps).

    Every slot 1..capacity is exactly one of: free, owned by the prefix cache, or
    private to one running request (its positions [tree_len, num_computed)).  Each tree
    node's lock count is the number of running requests reusing it, and a request's
    first tree_len positions point at its locked prefix's slots; each node still in the
    tree has as many pins as waiting retracted requests whose kept positions go through
    it.  With a `policy` that reserves, available slots cover every running request's
    worst case, so none can run out.  It takes the pool (and its prefix cache,
    `pool.tree`) and the engine's queues, not the engine.
    """
    tree = pool.tree
    owner: dict[int, str] = {}

    def claim(slots: list[int], who: str) -> None:
        for s in slots:
            assert 1 <= s <= pool.capacity, f"{who} holds slot {s}, outside 1..{pool.capacity}"
            assert s not in owner, f"slot {s} is both {owner[s]} and {who}"
            owner[s] = who

    claim(pool.free_slot_list(), "free")
    if tree is not None:
        _check_tree(tree, claim)
    locks: dict[int, int] = {}
    rows = set()
    for req in running:
        assert req.row >= 0 and req.row not in rows, f"{req.rid}: bad or shared row {req.row}"
        rows.add(req.row)
        assert req.tree_len <= req.num_computed <= req.total_len, f"{req.rid}: tree_len/num_computed out of order"
        assert req.prompt_len <= req.prefill_len <= req.total_len, f"{req.rid}: prefill_len out of range"
        assert req.pinned is None, f"running {req.rid} still pins the cache"
        table = pool.req_to_token[req.row]
        claim(table[req.tree_len : req.num_computed].tolist(), f"private to {req.rid}")
        if tree is None:
            assert req.tree_len == 0 and req.tree_node is None, f"{req.rid}: tree state without a tree"
            continue
        assert req.tree_node is not None, f"{req.rid}: running without a tree node"
        path = list(tree.path(req.tree_node))
        assert sum(len(n.value) for n in path) == req.tree_len, f"{req.rid}: locked prefix length != tree_len"
        prefix = torch.cat([n.value for n in reversed(path)]) if path else table[:0]
        assert torch.equal(table[: req.tree_len], prefix), f"{req.rid}: row does not point at its tree prefix"
        if path:
            assert path[-1].parent is tree.root, f"{req.rid}: its tree node is detached"
        _count(path, locks)
    pins: dict[int, int] = {}
    for req in waiting:
        assert req.row == -1 and req.tree_node is None and req.num_computed == 0, f"waiting {req.rid} holds KV"
        if req.pinned is not None:
            assert tree is not None, f"{req.rid}: pinned without a tree"
            _count(list(tree.path(req.pinned)), pins)
    if tree is not None:
        for node in tree.nodes():
            assert node.lock_ref == locks.get(id(node), 0), (
                f"tree node lock_ref {node.lock_ref} != {locks.get(id(node), 0)} running requests using it"
            )
            assert node.pin_ref == pins.get(id(node), 0), (
                f"tree node pin_ref {node.pin_ref} != {pins.get(id(node), 0)} retracted requests keeping it"
            )
    assert len(owner) == pool.capacity, f"{pool.capacity - len(owner)} slots are neither free, cached nor owned"
    assert pool.free_rows + len(running) == pool.max_requests, "request rows leaked"
    if policy is not None and policy.reserve:
        worst = policy.committed(running)
        assert worst <= pool.available, f"reserve: running requests may need {worst} slots, {pool.available} left"


def _check_tree(tree: RadixCache, claim) -> None:
    nodes = list(tree.nodes())
    for node in nodes:
        if node.ns is not None:  # a namespace: no tokens, the root's child under its name
            assert not node.key and not len(node.value) and node.parent is tree.root, "bad namespace node"
            assert tree.root.children.get(node.ns) is node, "namespace link broken"
            continue
        assert node.key and len(node.key) == len(node.value), "tree node with an empty or mismatched key"
        assert node.parent is not None and node.parent.children.get(node.key[0]) is node, "tree link broken"
        claim(node.value.tolist(), "tree")
    assert tree.total_slots == sum(len(n.value) for n in nodes), "tree total_slots is off"
    assert tree.locked_slots == sum(len(n.value) for n in nodes if n.lock_ref > 0), "tree locked_slots is off"


def _count(path: list[TreeNode], into: dict[int, int]) -> None:
    for n in path:
        into[id(n)] = into.get(id(n), 0) + 1
