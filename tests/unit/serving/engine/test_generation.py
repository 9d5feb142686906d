"""Greedy generation through the Scheduler core equals transformers' `generate`."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import PROMPTS, collect, encode, greedy, hf_greedy, make_core


@pytest.fixture(scope="module")
def references():
    cache: dict[tuple[str, str, int], list[int]] = {}

    def ref(model, prompt: str, n: int = 32) -> list[int]:
        key = (model.name, prompt, n)
        if key not in cache:
            cache[key] = hf_greedy(model, encode(model, prompt), n)
        return cache[key]

    return ref


def test_alone_equals_transformers(any_model, references):
    """One engine, one request at a time: each starts on an empty cache, as on an engine of its own."""
    core = make_core(any_model, max_total_tokens=1024)
    for i, prompt in enumerate(PROMPTS[:3]):
        core.add_request(f"a{i}", encode(any_model, prompt), greedy(32))
        out = collect(core)[f"a{i}"]
        assert out == references(any_model, prompt), prompt
        assert core.pool.is_idle() and core.flush_cache() and core.pool.is_empty()


def test_batch_with_joins_mid_flight_equals_transformers(any_model, references):
    """Different prompt lengths, joining at different steps, finishing at different times."""
    core = make_core(any_model, max_prefill_tokens=8, max_total_tokens=1024)  # small budget: prefills chunk, interleave
    lengths = [32, 20, 32, 9, 27]
    joins = {0: [0, 1], 3: [2], 7: [3], 12: [4]}  # step -> prompt indices joining then
    outs: dict[str, list[int]] = {}
    step = 0
    while step <= max(joins) or core.has_work:
        for i in joins.get(step, []):
            core.add_request(f"r{i}", encode(any_model, PROMPTS[i]), greedy(lengths[i]))
        for ev in core.step():
            outs.setdefault(ev.rid, []).extend(ev.new_token_ids)
        step += 1
    for i, prompt in enumerate(PROMPTS):
        assert outs[f"r{i}"] == references(any_model, prompt, 32)[: lengths[i]], prompt
    assert core.pool.is_idle() and core.flush_cache() and core.pool.is_empty()


def test_chunked_prefill_equals_unchunked(smollm):
    """One engine, its prefill budget (read at every step by its batch builder) set for each run and its cache
    flushed between them: the whole prompt in one step, in chunks of 64, in chunks of 17."""
    long_prompt = " ".join(PROMPTS * 6)  # ~150 tokens
    ids = encode(smollm, long_prompt)
    assert len(ids) > 100
    outs = []
    core = make_core(smollm, max_total_tokens=512)
    for chunk in (512, 64, 17):
        core.args = core.batches.args = dataclasses.replace(core.args, max_prefill_tokens=chunk)
        req = core.add_request(f"x{chunk}", ids, greedy(16))
        outs.append(collect(core)[f"x{chunk}"])
        assert len(req.times.prefill_chunks) == -(-len(ids) // chunk)
        assert sum(n for _, _, n in req.times.prefill_chunks) == len(ids)
        assert core.pool.is_idle() and core.flush_cache() and core.pool.is_empty()
    assert outs[0] == outs[1] == outs[2]
    assert outs[0] == hf_greedy(smollm, ids, 16)


def test_stop_token_ids_and_max_new_tokens(tiny, references):
    ref = references(tiny, PROMPTS[1])
    stop_at = ref[5]
    core = make_core(tiny)
    a = core.add_request("a", encode(tiny, PROMPTS[1]), greedy(32, stop_token_ids=[stop_at]))
    b = core.add_request("b", encode(tiny, PROMPTS[1]), greedy(4))
    outs = collect(core)
    first = ref.index(stop_at)
    assert outs["a"] == ref[: first + 1]
    assert a.finish_reason.value == "stop" and a.matched_stop == stop_at
    assert outs["b"] == ref[:4] and b.finish_reason.value == "length"


def test_context_window_limits(tiny):
    core = make_core(tiny, context_length=40)
    ids = encode(tiny, PROMPTS[1])
    req = core.add_request("a", ids, greedy(1000, ignore_eos=True))
    out = collect(core)["a"]
    assert len(ids) + len(out) == 40 and req.finish_reason.value == "length"
    with pytest.raises(ValueError, match="context window"):
        core.add_request("b", list(range(5, 45)), greedy(4))
    with pytest.raises(ValueError, match="empty"):
        core.add_request("c", [], greedy(4))
    with pytest.raises(ValueError, match="token ids"):
        core.add_request("d", [10**7], greedy(4))
