"""Stall-free batching: while requests decode, a step's tokens are capped, so a long prompt
arriving cannot stretch their inter-token gaps; prompts still progress every step."""

from __future__ import annotations

from tests.helpers import encode, greedy, make_core

LONG = "word " * 400


def test_a_long_prompt_is_chunked_under_the_step_budget_while_others_decode(tiny):
    core = make_core(  # the token cap alone (the time budget: test_step_budget)
        tiny,
        max_prefill_tokens=512,
        max_step_tokens=64,
        min_prefill_chunk=16,
        max_total_tokens=8192,
        step_time_factor=0,
    )
    for i in range(20):
        core.add_request(f"d{i}", encode(tiny, f"Short prompt number {i}"), greedy(40, ignore_eos=True))
    core.step()  # nothing decodes yet: all short prompts prefill in one step, up to --max-prefill-tokens
    assert core.last_step.num_prefill_tokens > 64 and core.last_step.num_decode == 0
    long_ids = encode(tiny, LONG)
    core.add_request("long", long_ids, greedy(4, ignore_eos=True))
    chunks = []
    while core.reqs["long"].num_computed < len(long_ids):
        core.step()
        st = core.last_step
        assert st.num_decode == 20 and st.num_decode + st.num_prefill_tokens <= 64
        chunks.append(st.num_prefill_tokens)
    assert sum(chunks) == len(long_ids) and set(chunks[:-1]) == {64 - 20}  # the budget the decodes leave


def test_prefill_always_progresses_under_a_full_batch(tiny):
    core = make_core(tiny, max_step_tokens=8, min_prefill_chunk=16, step_time_factor=0)
    assert core.batches.prefill_budget(0) == core.args.max_prefill_tokens
    assert core.batches.prefill_budget(4) == 16  # 8 - 4 would starve prompts: the floor wins
    capped = make_core(tiny, max_prefill_tokens=10, step_time_factor=0)
    assert capped.batches.prefill_budget(3) == 10  # never above --max-prefill-tokens
