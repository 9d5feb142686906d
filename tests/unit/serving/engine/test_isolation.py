"""One request's failure inside an engine step ends that request alone.

The batch mates of a request that makes the forward or the sampler raise must keep
running and produce exactly the tokens they produce alone; the failed request ends with
finish_reason error, and its KV (including the failed step's allocation) is freed.
"""

from __future__ import annotations

import pytest

from protocol.reasons import FinishReason
from protocol.sampling_params import SamplingParams
from serving.engine.forward_pass import FAULT_SEED_ENV
from tests.helpers import PROMPTS, encode, greedy, make_core

N = 24


def alone(model, prompt: str) -> list[int]:
    core = make_core(model)
    core.add_request("solo", encode(model, prompt), greedy(N, ignore_eos=True))
    return [t for ev in core.run_to_completion() for t in ev.new_token_ids]


def run_with_culprit(model, corrupt, after_steps: int):
    """A greedy request and a sampled one that `corrupt` breaks after `after_steps` steps.

    The corruption stands for any value that slips past validation and makes torch raise.
    """
    core = make_core(model)
    core.add_request("good", encode(model, PROMPTS[1]), greedy(N, ignore_eos=True))
    bad = core.add_request(
        "bad", encode(model, PROMPTS[2]), SamplingParams(max_new_tokens=N, temperature=1.0, seed=3, ignore_eos=True)
    )
    events = [ev for _ in range(after_steps) for ev in core.step()]
    corrupt(bad)
    events += core.run_to_completion()
    tokens = {rid: [t for ev in events if ev.rid == rid for t in ev.new_token_ids] for rid in ("good", "bad")}
    finals = {ev.rid: ev for ev in events if ev.finished}
    return core, tokens, finals


def break_penalty(req) -> None:
    req.params.repetition_penalty = 1.5  # penalises the ids seen so far: the sampler indexes the logits
    req.output_ids[0] = 10**9  # ... with one past the vocabulary (forward, which feeds the last, is fine)


def break_prompt(req) -> None:
    req.input_ids[0] = 10**9  # the prefill feeds it to the embedding: an index error in the forward


def break_last_token(req) -> None:
    req.output_ids[-1] = 10**9  # the next decode feeds it to the embedding: an index error in the forward


@pytest.mark.parametrize(
    "corrupt,after_steps",
    [
        (break_penalty, 3),
        (break_prompt, 0),
        (break_last_token, 3),
    ],
    ids=["sampler-mid-decode", "forward-at-prefill", "forward-mid-decode"],
)
def test_failing_request_leaves_its_batch_mate_untouched(tiny, corrupt, after_steps):
    core, tokens, finals = run_with_culprit(tiny, corrupt, after_steps)
    assert tokens["good"] == alone(tiny, PROMPTS[1])
    assert finals["good"].finish_reason is FinishReason.LENGTH
    assert finals["bad"].finish_reason is FinishReason.ERROR and finals["bad"].error
    assert len(tokens["bad"]) == after_steps  # what it produced before the fault, nothing after
    assert core.failed_requests == 1
    core.check_kv_invariants()
    assert core.pool.is_idle()  # its KV and the failed step's allocation were handed back
    assert core.flush_cache() and core.pool.is_empty()  # what remained was prefix cache


def test_every_culprit_is_found_among_many_mates(tiny, monkeypatch):
    monkeypatch.setenv(FAULT_SEED_ENV, "77")
    core = make_core(tiny)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"good{i}", encode(tiny, prompt), greedy(N, ignore_eos=True))
        if i in (1, 3):
            core.add_request(f"bad{i}", encode(tiny, prompt), greedy(N, seed=77))
    events = core.run_to_completion()
    out: dict[str, list[int]] = {}
    for ev in events:
        out.setdefault(ev.rid, []).extend(ev.new_token_ids)
    reasons = {ev.rid: ev.finish_reason for ev in events if ev.finished}
    assert reasons == {
        **{f"good{i}": FinishReason.LENGTH for i in range(5)},
        "bad1": FinishReason.ERROR,
        "bad3": FinishReason.ERROR,
    }
    for i, prompt in enumerate(PROMPTS):
        assert out[f"good{i}"] == alone(tiny, prompt)
    assert core.failed_requests == 2 and core.pool.is_idle()
    assert core.flush_cache() and core.pool.is_empty()
