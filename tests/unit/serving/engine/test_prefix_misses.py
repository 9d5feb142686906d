"""Why the prefix cache missed: the log of evicted prefixes (per namespace, bounded) and the reason a
request's match ended where it did, on the tree alone and on the real engine."""

from __future__ import annotations

import torch

from serving.engine.prefix_misses import BLOCK, EvictedLog, PrefixMisses
from serving.engine.radix_cache import RadixCache
from tests.helpers import greedy, make_core


def slots(n: int, base: int = 0) -> torch.Tensor:
    return torch.arange(base, base + n, dtype=torch.int64)


def tree_with_log() -> tuple[RadixCache, PrefixMisses]:
    tree, misses = RadixCache(), PrefixMisses()
    tree.evicted = misses.log
    return tree, misses


def test_an_evicted_prefix_is_told_from_one_never_seen_and_never_crosses_namespaces():
    tree, misses = tree_with_log()
    ids = list(range(100, 164))  # 4 blocks
    tree.insert(ids, slots(64), "a")
    assert len(tree.evict(64)) == 64
    looked = ids + [7, 8, 9]
    miss = misses.explain(looked, 0, "a")
    assert (miss.reason, miss.matched_tokens, miss.evicted_tokens, miss.lookup_tokens) == ("evicted", 0, 64, 67)
    assert misses.explain(looked, 0, "b").reason == "never_seen"  # another tenant's evicted prompt: not its own
    assert misses.explain(looked, 0, "").reason == "never_seen"
    assert misses.explain(list(range(500, 600)), 0, "a").reason == "never_seen"
    assert misses.explain(list(range(5)), 0, "a").reason == "too_short"  # no block boundary in the rest
    assert misses.explain(ids, 64, "a") is None  # a full match is a hit
    assert misses.counts == {"evicted": 1, "never_seen": 3, "too_short": 1}


def test_where_the_match_ended_and_how_much_past_it_was_evicted():
    tree, misses = tree_with_log()
    base = list(range(1000, 1040))  # 40 tokens kept: a running request locks them
    ids = base + list(range(2000, 2060))  # a 100-token prompt
    tree.insert(ids, slots(100))
    _, node = tree.match_prefix(base)
    tree.inc_lock(node)
    assert len(tree.evict(60)) == 60  # only [40, 100) could go
    matched = len(tree.match_prefix(ids)[0])
    assert matched == 40
    miss = misses.explain(ids, matched, "")
    assert miss.reason == "evicted" and miss.evicted_tokens == 96 - 40  # whole blocks up to 96
    assert miss.attributes()["sightline.prefix_cache.matched_tokens"] == 40
    other = base + list(range(3000, 3060))  # same cached start, a rest never cached
    assert misses.explain(other, 40, "").reason == "never_seen"


def test_a_flush_is_logged_and_the_log_is_bounded():
    tree, misses = tree_with_log()
    ids = list(range(10, 10 + 4 * BLOCK))
    tree.insert(ids, slots(len(ids)), "t")
    tree.reset()
    assert misses.explain(ids + [1], 0, "t").reason == "evicted"
    log = EvictedLog(maxlen=8)
    for i in range(5):
        log.evicted(list(range(i * 1000, i * 1000 + 4 * BLOCK)), 0, "")  # 4 hashes each
    assert len(log.hashes) == 8  # the oldest prefixes went first


def test_on_the_engine_a_prompt_evicted_by_others_misses_as_evicted(tiny):
    core = make_core(tiny, max_total_tokens=1024, max_prefill_tokens=512, max_step_tokens=512, num_threads=1)
    prompt = [3 + j % 700 for j in range(300)]
    first = core.add_request("first", prompt, greedy(2, ignore_eos=True))
    core.run_to_completion()
    assert first.prefix_miss.reason == "never_seen" and first.prefix_miss.matched_tokens == 0
    again = core.add_request("again", prompt, greedy(2, ignore_eos=True))
    core.run_to_completion()
    assert again.prefix_miss is None and again.cached_tokens == 299  # a hit: nothing to explain
    for i in range(4):  # others' prompts fill the pool: the least recently used prefix goes
        core.add_request(f"other{i}", [800 + i] * 400, greedy(2, ignore_eos=True))
        core.run_to_completion()
    assert core.prefix_evicted_tokens > 0
    late = core.add_request("late", prompt, greedy(2, ignore_eos=True))
    core.run_to_completion()
    assert late.prefix_miss.reason == "evicted" and late.prefix_miss.evicted_tokens > 0, late.prefix_miss
    counts = {m.reason: m.count for m in core.cache.misses.snapshot()}
    assert counts["evicted"] == 1 and counts["never_seen"] == 5
