"""KV pool accounting: every finish and every abort gives its slots back.

With the prefix cache on (the default) a finished or aborted request's computed
positions stay in the cache: the pool is then idle (`is_idle`: nothing reserved, every
used slot is unlocked cache) and empty only after `flush_cache`.
"""

from __future__ import annotations

import random

import pytest

from protocol.sampling_params import SamplingParams
from serving.engine.kv_pool import KVPool
from tests.helpers import PROMPTS, collect, encode, greedy, make_core


def test_abort_at_every_stage_frees_kv(tiny):
    core = make_core(tiny, max_prefill_tokens=8, max_running_requests=2)
    long_ids = encode(tiny, " ".join(PROMPTS))  # needs several 8-token chunks
    core.add_request("decoding", encode(tiny, PROMPTS[0]), greedy(50, ignore_eos=True))
    core.add_request("prefilling", long_ids, greedy(50))
    core.add_request("queued", encode(tiny, PROMPTS[2]), greedy(50))  # max_running=2 keeps it waiting
    core.step()
    core.step()
    assert core.reqs["decoding"].prefill_done and core.reqs["decoding"].output_ids
    assert 0 < core.reqs["prefilling"].num_computed < len(long_ids)
    assert core.reqs["queued"] in core.waiting
    used_before = core.pool.used_slots
    for rid in ("queued", "prefilling", "decoding"):
        ev = core.abort(rid)
        assert ev is not None and ev.finish_reason.value == "abort"
        assert rid not in core.reqs
    assert core.pool.is_idle() and not core.has_work
    assert 0 < core.pool.used_slots == core.prefix_cached_tokens <= used_before  # what they computed, cached
    core.check_kv_invariants()
    assert core.flush_cache() and core.pool.is_empty()
    assert core.abort("decoding") is None  # a second abort finds nothing (a stale message)


@pytest.mark.parametrize("cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_reserve_admission_waits_for_the_worst_case(tiny, cache):
    ids = encode(tiny, PROMPTS[0])
    need = len(ids) + 20
    core = make_core(
        tiny,
        max_total_tokens=need * 2 + need // 2,  # room for two, not three
        disable_prefix_cache=not cache,
        admission="reserve",
    )
    for i in range(3):
        core.add_request(f"r{i}", ids, greedy(20, ignore_eos=True))
    first = {ev.rid: ev.new_token_ids for ev in core.step()}
    assert core.num_running == 2 and core.num_waiting == 1  # admitted together: nothing cached yet
    if cache:  # the prompt, computed twice, is cached once and locked; each may still allocate its decodes
        assert core.policy.committed(core.running) == 2 * 20
        assert core.pool.locked_slots == core.pool.used_slots == core.pool.in_use == len(ids)
    else:
        assert core.kv_committed == 2 * need
        assert core.pool.used_slots <= core.kv_committed
    core.check_kv_invariants()
    outs = collect(core)
    assert all(len(first.get(f"r{i}", []) + outs[f"r{i}"]) == 20 for i in range(3))
    assert core.pool.is_idle()
    assert core.flush_cache() and core.pool.is_empty()


def test_no_leak_after_200_mixed_requests(tiny):
    rng = random.Random(7)
    core = make_core(tiny, max_prefill_tokens=24, max_running_requests=16, max_total_tokens=4096)
    vocab = core.vocab_size
    live: list[str] = []
    finished = 0
    for i in range(200):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]), seed=i
        )
        core.add_request(f"r{i}", ids, params)
        live.append(f"r{i}")
        for _ in range(rng.randint(0, 2)):
            finished += sum(ev.finished for ev in core.step())
        if rng.random() < 0.3:  # abort a random live request, whatever its stage
            rid = rng.choice(live)
            if core.abort(rid) is not None:
                finished += 1
        live = [r for r in live if r in core.reqs]
        core.check_kv_invariants()
    finished += sum(ev.finished for ev in core.run_to_completion())
    assert finished == 200
    assert core.pool.is_idle() and not core.reqs
    assert core.flush_cache() and core.pool.is_empty()


def test_pool_rejects_overdraw():
    pool = KVPool(1, 1, 4, num_slots=8, max_requests=2, max_context=16)
    with pytest.raises(RuntimeError):
        pool.admit(9)
    row = pool.admit(8)
    slots = pool.extend(row, 0, 8)
    assert sorted(slots.tolist()) == list(range(1, 9))  # slot 0 is the padding slot
    assert pool.available == 0 and pool.in_use == 8
    with pytest.raises(RuntimeError):
        pool.extend(row, 8, 1)
    with pytest.raises(RuntimeError):
        pool.admit(1)
    pool.release(row, 8)
    assert pool.is_empty()
