"""The prefix (radix) cache: the tree on its own, then the engine with it on and off.

Engine tests run the same requests with the cache on and off (`disable_prefix_cache`)
and require token-identical greedy outputs; the KV bookkeeping is checked after every
step (`SchedulerCore.check_kv_invariants`).
"""

from __future__ import annotations

import random

import pytest
import torch

from protocol.reasons import FinishReason
from protocol.sampling_params import SamplingParams
from serving.engine.forward_pass import FAULT_SEED_ENV
from serving.engine.radix_cache import RadixCache
from serving.engine.scheduler_core import SchedulerCore
from tests.helpers import greedy
from tests.helpers import make_core as _make_core


def make_core(model, **kw) -> SchedulerCore:
    # one torch thread: this model is tiny, and two threads on a busy 2-core box are ~20x slower
    return _make_core(model, **{"num_threads": 1, **kw})


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# -- the tree ---------------------------------------------------------------------------
def test_match_splits_and_insert_reports_what_was_present():
    tree = RadixCache()
    slots, node = tree.match_prefix([1, 2, 3])
    assert len(slots) == 0 and node is tree.root
    assert tree.insert([1, 2, 3, 4], t(11, 12, 13, 14)) == 0
    assert tree.total_slots == 4 and len(tree.root.children) == 1
    slots, node = tree.match_prefix([1, 2, 9])  # ends inside the edge: split after [1, 2]
    assert slots.tolist() == [11, 12] and node.key == (1, 2)
    assert [c.key for c in node.children.values()] == [(3, 4)]
    assert tree.total_slots == 4  # splitting moves no slot
    assert tree.insert([1, 2, 5], t(21, 22, 25)) == 2  # the caller frees its 21, 22
    assert tree.match_prefix([1, 2, 5, 6])[0].tolist() == [11, 12, 25]
    assert tree.insert([1, 2, 3, 4], t(31, 32, 33, 34)) == 4  # all there: nothing taken
    assert tree.total_slots == 5
    src = t(41, 42)
    tree.insert([7, 8], src)
    src[:] = 0  # the tree copied the slots it took
    assert tree.match_prefix([7, 8])[0].tolist() == [41, 42]


def test_evict_is_lru_over_leaves_and_parents_follow():
    tree = RadixCache()
    tree.insert([1, 2, 3], t(1, 2, 3))
    tree.insert([1, 2, 4], t(1, 2, 4))  # splits: [1, 2] -> {[3], [4]}
    tree.insert([5, 6], t(5, 6))
    tree.match_prefix([5, 6])
    tree.match_prefix([1, 2, 4])  # [3] is now the least recently used leaf, [5, 6] next
    assert sorted(tree.evict(1).tolist()) == [3]
    assert sorted(tree.evict(1).tolist()) == [5, 6]  # whole leaves only
    assert sorted(tree.evict(3).tolist()) == [1, 2, 4]  # [4] first, then its parent became a leaf
    assert tree.total_slots == 0 and not tree.root.children
    assert len(tree.evict(10)) == 0


def test_locks_protect_the_path_and_survive_splits():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], t(1, 2, 3, 4))
    tree.insert([1, 2, 3, 4, 5, 6], t(1, 2, 3, 4, 5, 6))
    _, node = tree.match_prefix([1, 2, 3, 4])
    assert tree.lock_gain(node) == 4
    tree.inc_lock(node)
    assert tree.locked_slots == 4 and tree.evictable_slots == 2 and tree.lock_gain(node) == 0
    _, mid = tree.match_prefix([1, 2])  # splits the locked node: both halves stay locked
    assert mid.lock_ref == 1 and tree.locked_slots == 4
    assert sorted(tree.evict(100).tolist()) == [5, 6]  # only the unlocked tail goes
    with pytest.raises(RuntimeError):
        tree.reset()
    tree.dec_lock(node)
    assert tree.locked_slots == 0 and mid.lock_ref == 0
    with pytest.raises(RuntimeError):
        tree.dec_lock(node)
    root = tree.root  # requests with no cached prefix hold the root: a reset keeps it
    assert sorted(tree.reset().tolist()) == [1, 2, 3, 4] and tree.total_slots == 0 and tree.root is root


# -- the engine, cache on and off ---------------------------------------------------------
def drive(
    core: SchedulerCore,
    plan: dict[int, list[tuple[str, list[int], SamplingParams]]],
    aborts: dict[int, list[str]] | None = None,
) -> dict[str, list[int]]:
    """Add plan[step] before each step, abort aborts[step]; check the KV invariants after every step."""
    aborts = aborts or {}
    out: dict[str, list[int]] = {}
    step = 0
    while step <= max([*plan, *aborts, 0]) or core.has_work:
        for rid, ids, params in plan.get(step, []):
            core.add_request(rid, ids, params)
            out.setdefault(rid, [])
        for rid in aborts.get(step, []):
            core.abort(rid)
        core.check_kv_invariants()
        for ev in core.step():
            out[ev.rid].extend(ev.new_token_ids)
        core.check_kv_invariants()
        step += 1
        assert step < 10_000
    assert core.pool.is_idle() and not core.reqs
    return out


def both(model, plan, aborts=None, **kw) -> tuple[SchedulerCore, dict[str, list[int]]]:
    """Run `plan` with the cache off and on; outputs must be identical.  Returns the cache-on core."""
    ref = drive(make_core(model, disable_prefix_cache=True, **kw), plan, aborts)
    core = make_core(model, **kw)
    out = drive(core, plan, aborts)
    assert out == ref
    return core, out


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_disabled_cache_keeps_the_plain_accounting(tiny):
    core = make_core(tiny, disable_prefix_cache=True, admission="reserve")
    ids = rand_ids(random.Random(0), 30)
    core.add_request("a", ids, greedy(8, ignore_eos=True))
    core.step()
    assert core.tree is None and core.kv_committed == 30 + 8 and core.pool.used_slots == core.pool.in_use == 30
    core.run_to_completion()
    core.add_request("b", ids, greedy(8, ignore_eos=True))
    core.run_to_completion()
    assert core.pool.is_empty() and core.batches.prefix_hits_tokens == 0 and core.batches.prefix_queries_tokens == 60


def test_sharing_none_half_all_and_a_second_turn(tiny):
    rng = random.Random(1)
    base = rand_ids(rng, 40)
    half = base[:20] + rand_ids(rng, 20)
    other = rand_ids(rng, 40)
    p = greedy(8, ignore_eos=True)
    core, out = both(
        tiny, {0: [("base", base, p)], 12: [("other", other, p)], 24: [("half", half, p)], 36: [("same", base, p)]}
    )
    turn2 = base + out["base"] + rand_ids(rng, 5)  # a chat's next turn: the last reply token was never fed
    core2, out2 = both(tiny, {0: [("base", base, p)], 12: [("turn2", turn2, p)]})
    hits = [core.batches.prefix_hits_tokens, core2.batches.prefix_hits_tokens]
    assert hits == [0 + 0 + 20 + 39, 40 + 7]  # 'other' shares nothing; an identical prompt reuses all but one
    assert core.batches.prefix_queries_tokens == 160
    assert core.prefix_cached_tokens == 47 + 47 + 27 + 0  # prompt + fed outputs, shared parts once
    assert core.flush_cache() and core.pool.is_empty() and core.cache_flushes == 1


def test_cached_tokens_per_request(tiny):
    rng = random.Random(2)
    base = rand_ids(rng, 30)
    core = make_core(tiny, admission="reserve")
    core.add_request("a", base, greedy(4, ignore_eos=True))
    core.run_to_completion()
    b = core.add_request("b", base[:25] + rand_ids(rng, 5), greedy(4, ignore_eos=True))
    c = core.add_request("c", base, greedy(4, ignore_eos=True))
    core.step()
    assert (b.cached_tokens, c.cached_tokens) == (25, 29)
    # after the prefill: only their decode slots remain to allocate (3 more tokens, and the one sampled)
    assert core.policy.need(b) == core.policy.need(c) == 4
    core.check_kv_invariants()


def test_two_requests_share_a_prefix_in_flight(tiny):
    rng = random.Random(3)
    prefix = rand_ids(rng, 32)
    a, b, c = prefix + rand_ids(rng, 12), prefix + rand_ids(rng, 8), prefix + rand_ids(rng, 4)
    p = greedy(12, ignore_eos=True)
    # with 8-token chunks b joins as a prefills its last chunk, and c while b prefills:
    # each reuses the prefix as the running requests cached it
    core, _ = both(tiny, {0: [("a", a, p)], 2: [("b", b, p)], 3: [("c", c, p)]}, max_prefill_tokens=8)
    assert core.batches.prefix_hits_tokens == 32 + 32
    # admitted in the same step: each computes the prefix, the cache keeps one copy
    core = make_core(tiny)
    core.add_request("a", a, p)
    core.add_request("b", b, p)
    core.step()
    core.check_kv_invariants()
    assert core.batches.prefix_hits_tokens == 0 and core.prefix_cached_tokens == 32 + 12 + 8
    assert core.pool.used_slots == core.prefix_cached_tokens
    both(tiny, {0: [("a", a, p), ("b", b, p)], 1: [("c", c, p)]})


@pytest.mark.parametrize("victim,at,hits", [("a", 3, 24), ("b", 7, 40)])
def test_abort_while_prefilling_a_shared_prefix(tiny, victim, at, hits):
    """a prefills a 50-token prompt in 8-token chunks; b shares its first 40 tokens.

    a aborted after 3 chunks: b reuses the 24 positions a cached.  b aborted while it
    prefills its own tail: a, decoding on the shared prefix, is untouched.
    """
    rng = random.Random(4)
    prefix = rand_ids(rng, 40)
    a, b = prefix + rand_ids(rng, 10), prefix + rand_ids(rng, 10)
    p = greedy(10, ignore_eos=True)
    core, out = both(tiny, {0: [("a", a, p)], 2: [("b", b, p)]}, aborts={at: [victim]}, max_prefill_tokens=8)
    survivor = "b" if victim == "a" else "a"
    assert len(out[survivor]) == 10 and out[victim] == []
    assert core.batches.prefix_hits_tokens == hits
    assert core.flush_cache() and core.pool.is_empty()


def test_eviction_under_pressure_spares_locked_prefixes(tiny):
    rng = random.Random(5)
    x = rand_ids(rng, 40)
    y = x[:30] + rand_ids(rng, 10)
    z = rand_ids(rng, 50)
    plan = {
        0: [("x", x, greedy(8, ignore_eos=True))],
        12: [("y", y, greedy(8, ignore_eos=True)), ("z", z, greedy(20, ignore_eos=True))],
    }
    core, _ = both(tiny, plan, max_total_tokens=128)
    # x left 47 slots cached; y locks 30 of them while z needs more than the free stack holds
    assert core.batches.prefix_hits_tokens == 30
    assert core.prefix_evicted_tokens > 0
    core.check_kv_invariants()
    # a waiting request is admitted only when its lock and reservation fit beside the others
    core = make_core(tiny, max_total_tokens=64)
    core.add_request("x", x, greedy(8, ignore_eos=True))
    core.run_to_completion()
    core.add_request("y", y, greedy(20, ignore_eos=True))  # 30 reused + 10 + 20 of its own
    core.add_request("z", rand_ids(rng, 20), greedy(10, ignore_eos=True))  # 30: does not fit beside y
    core.step()
    assert core.num_running == 1 and core.num_waiting == 1
    core.check_kv_invariants()
    assert collect_all(core) and core.pool.is_idle()


def collect_all(core: SchedulerCore) -> bool:
    while core.has_work:
        core.step()
        core.check_kv_invariants()
    return True


def test_chunked_prefill_starting_inside_a_cached_prefix(tiny):
    rng = random.Random(6)
    x = rand_ids(rng, 40)
    y = x[:30] + rand_ids(rng, 30)
    plan = {0: [("x", x, greedy(6, ignore_eos=True))], 10: [("y", y, greedy(6, ignore_eos=True))]}
    core = make_core(tiny, max_prefill_tokens=8)
    ref = drive(make_core(tiny, max_prefill_tokens=8, disable_prefix_cache=True), plan)
    req = None
    out: dict[str, list[int]] = {}
    for step in range(200):
        for rid, ids, params in plan.get(step, []):
            req = core.add_request(rid, ids, params)
        for ev in core.step():
            out.setdefault(ev.rid, []).extend(ev.new_token_ids)
        core.check_kv_invariants()
        if step > 10 and not core.has_work:
            break
    assert out == ref
    assert req is not None and req.cached_tokens == 30
    assert [n for _, _, n in req.times.prefill_chunks] == [8, 8, 8, 6]


def test_a_failing_request_on_a_shared_prefix_leaves_the_cache_sound(tiny, monkeypatch):
    monkeypatch.setenv(FAULT_SEED_ENV, "99")
    rng = random.Random(7)
    prefix = rand_ids(rng, 24)
    core = make_core(tiny, max_prefill_tokens=8)
    core.add_request("good", prefix + rand_ids(rng, 6), greedy(6, ignore_eos=True))
    core.step()
    core.step()
    core.add_request("bad", prefix + rand_ids(rng, 6), greedy(6, seed=99))
    reasons = {}
    while core.has_work:
        reasons.update({ev.rid: ev.finish_reason for ev in core.step() if ev.finished})
        core.check_kv_invariants()
    assert reasons == {"good": FinishReason.LENGTH, "bad": FinishReason.ERROR}
    assert core.pool.is_idle() and core.flush_cache() and core.pool.is_empty()


def test_flush_is_refused_while_requests_run_unless_forced(tiny):
    rng = random.Random(8)
    x = rand_ids(rng, 20)
    core = make_core(tiny)
    core.add_request("x", x, greedy(4, ignore_eos=True))
    core.run_to_completion()
    core.add_request("y", x[:10] + rand_ids(rng, 10), greedy(30, ignore_eos=True))
    core.step()
    assert not core.flush_cache() and core.cache_flushes == 0
    before = core.prefix_cached_tokens
    assert core.flush_cache(force=True) and core.cache_flushes == 1
    assert core.prefix_cached_tokens == core.pool.locked_slots == 20 < before  # y's prompt stays
    core.check_kv_invariants()
    collect_all(core)
    assert core.flush_cache() and core.pool.is_empty()


def test_200_mixed_requests_with_aborts_match_the_uncached_engine(tiny):
    rng = random.Random(9)
    systems = [rand_ids(rng, n) for n in (12, 30, 45)]
    plan: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    aborts: dict[int, list[str]] = {}
    prompts: list[list[int]] = []
    kinds: dict[str, bool] = {}  # rid -> greedy
    for i in range(200):
        kind = rng.random()
        if kind < 0.5:
            ids = rng.choice(systems) + rand_ids(rng, rng.randint(1, 12))
        elif kind < 0.7 and prompts:
            ids = list(rng.choice(prompts))  # a repeat
        elif kind < 0.8 and prompts:
            ids = rng.choice(prompts)[: rng.randint(1, 20)] + rand_ids(rng, rng.randint(1, 8))
        else:
            ids = rand_ids(rng, rng.randint(1, 40))
        prompts.append(ids)
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True
        )
        kinds[f"r{i}"] = params.temperature == 0.0
        step = i // 2
        plan.setdefault(step, []).append((f"r{i}", ids, params))
        if rng.random() < 0.2:
            aborts.setdefault(step + rng.randint(0, 6), []).append(f"r{i}")
    kw = dict(max_prefill_tokens=24, max_running_requests=12, max_total_tokens=600)
    ref_core = make_core(tiny, disable_prefix_cache=True, **kw)
    ref = drive(ref_core, plan, aborts)
    core = make_core(tiny, **kw)
    out = drive(core, plan, aborts)
    # Greedy requests that were not aborted (an aborted one may get further in one run than in
    # the other) agree exactly.  Sampled ones are there for the accounting: reused K/V were
    # computed in other batches, so logits differ by float rounding (~1e-5), enough to move
    # an inverse-CDF draw now and then (the engine without the cache is no different when
    # batch mates change).
    aborted = {rid for rids in aborts.values() for rid in rids}
    compared = [rid for rid, greedy_ in kinds.items() if greedy_ and rid not in aborted]
    assert len(compared) > 60
    for rid in compared:
        assert out[rid] == ref[rid], rid
    assert core.batches.prefix_hits_tokens > 0 and core.prefix_evicted_tokens > 0
    assert core.pool.is_idle() and core.pool.used_slots == core.prefix_cached_tokens
    assert core.flush_cache() and core.pool.is_empty()
    assert ref_core.pool.is_empty()
