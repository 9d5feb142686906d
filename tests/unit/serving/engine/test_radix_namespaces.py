"""Prefix-cache namespaces (tenants, cache salts), the priority queue and the CPU split.

One tree: a namespace is a root-level node, lookups never leave it, eviction is one LRU
order over every namespace; the KV bookkeeping is checked after every step.
"""

from __future__ import annotations

import random

import torch

from serving.engine.cpu_share import CpuLedger
from serving.engine.radix_cache import RadixCache
from serving.engine.request import Req
from serving.engine.wait_queue import WaitQueue
from tests.helpers import greedy
from tests.helpers import make_core as _make_core


def make_core(model, **kw):
    return _make_core(model, **{"num_threads": 1, **kw})


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_a_namespace_sees_only_its_own_prefixes():
    tree = RadixCache()
    assert tree.insert([1, 2, 3, 4], t(11, 12, 13, 14), "a") == 0
    assert tree.match_prefix([1, 2, 3, 4])[0].tolist() == []  # the shared namespace has none of it
    slots, node = tree.match_prefix([1, 2, 3, 9], "b")
    assert len(slots) == 0 and node is tree.root  # nothing to lock, not even b's namespace
    assert tree.match_prefix([1, 2, 3, 9], "a")[0].tolist() == [11, 12, 13]
    assert tree.insert([1, 2, 3, 4], t(21, 22, 23, 24), "b") == 0  # b computes its own copy
    assert tree.insert([1, 2], t(31, 32)) == 0
    assert tree.total_slots == 10
    assert {n.ns for n in tree.root.children.values()} == {"a", "b", None}


def test_eviction_is_one_lru_order_over_every_namespace():
    tree = RadixCache()
    tree.insert([1, 2], t(1, 2), "a")
    tree.insert([3, 4], t(3, 4), "b")
    tree.insert([5, 6], t(5, 6))
    tree.match_prefix([1, 2], "a")  # a's is the most recent now
    assert sorted(tree.evict(2).tolist()) == [3, 4]  # b's leaf was the least recent of all
    assert "b" not in tree.root.children or not tree.root.children["b"].children
    assert sorted(tree.evict(4).tolist()) == [1, 2, 5, 6]
    assert tree.total_slots == 0 and not tree.root.children  # emptied namespaces went too


def test_locks_in_a_namespace_protect_its_path():
    tree = RadixCache()
    tree.insert([1, 2, 3], t(1, 2, 3), "a")
    _, node = tree.match_prefix([1, 2, 3], "a")
    tree.inc_lock(node)
    assert tree.locked_slots == 3 and tree.evict(3).tolist() == []
    tree.dec_lock(node)
    assert sorted(tree.evict(3).tolist()) == [1, 2, 3]


def test_requests_of_two_namespaces_never_share_in_the_engine(tiny):
    rng = random.Random(7)
    prompt = [rng.randrange(1, 200) for _ in range(40)]
    core = make_core(tiny, admission="reserve")
    core.add_request("a1", prompt, greedy(4, ignore_eos=True), namespace="A")
    core.run_to_completion()
    b = core.add_request("b1", prompt, greedy(4, ignore_eos=True), namespace="B")
    a = core.add_request("a2", prompt, greedy(4, ignore_eos=True), namespace="A")
    shared = core.add_request("s", prompt, greedy(4, ignore_eos=True))
    while core.has_work:
        core.step()
        core.check_kv_invariants()
    assert (b.cached_tokens, a.cached_tokens, shared.cached_tokens) == (0, 39, 0)
    assert core.batches.prefix_hits_tokens == 39
    assert b.output_ids == a.output_ids == shared.output_ids  # the same tokens, computed again
    assert core.flush_cache() and core.pool.is_empty()


def test_eviction_under_pressure_across_namespaces_keeps_the_books(tiny):
    rng = random.Random(8)
    core = make_core(tiny, max_total_tokens=160)
    for i in range(12):
        ids = [rng.randrange(1, 200) for _ in range(30)]
        core.add_request(f"r{i}", ids, greedy(6, ignore_eos=True), priority=i % 3, namespace=f"ns{i % 4}")
    while core.has_work:
        core.step()
        core.check_kv_invariants()
    assert core.prefix_evicted_tokens > 0 and core.pool.is_idle()


def _req(rid: str, priority: int) -> Req:
    return Req(rid=rid, input_ids=[1], params=greedy(1), generator=torch.Generator(), priority=priority)


def test_the_wait_queue_puts_higher_priority_first_and_keeps_arrival_order_within_one():
    q = WaitQueue()
    for rid, p in (("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 2)):
        q.append(_req(rid, p))
    assert [r.rid for r in q] == ["e", "b", "d", "a", "c"]
    q.appendleft(_req("x", 1))  # retracted: ahead of its own priority, behind a higher one
    assert [r.rid for r in q] == ["e", "x", "b", "d", "a", "c"]
    assert q.popleft().rid == "e"


def test_admission_follows_priority(tiny):
    core = make_core(tiny, max_running_requests=1)
    core.add_request("low", [5] * 10, greedy(2, ignore_eos=True), priority=0)
    core.add_request("high", [6] * 10, greedy(2, ignore_eos=True), priority=5)
    core.step()
    assert [r.rid for r in core.running] == ["high"]


def test_cpu_is_split_by_tokens_and_sums_to_the_step():
    ledger = CpuLedger()
    ledger.charge(("a", "b", "c"), (1, 1, 30), 1_000_003)
    shares = [ledger.of(r, done=False) for r in "abc"]
    assert sum(shares) == 1_000_003 and shares[0] == shares[1] == 1_000_003 // 32
    assert ledger.of("c", done=True) == shares[2] and ledger.of("c", done=False) == 0
