"""Admission on an estimate, and retraction when decode would run out of KV.

The pools here are small enough that the running requests outgrow them: the engine
must retract some, resume them later, and every request must still produce exactly the
tokens it produces alone (greedy, and seeded sampling: its generator travels with it).
The KV invariants are checked after every step, and the retraction counters must equal
the retractions the requests went through.

Sampled requests here use top-k.  K/V recomputed on resumption (without the prefix
cache, or after its pinned entries were evicted) goes through the prefill path, which
can differ in the last bits from what the decode path computed; over tiny-random's
near-uniform 49k-token distribution that moves about one draw in twenty across a token
boundary (the draws themselves are the same: `test_a_resumed_request_makes_the_same_draws`).
A trained model's peaked distributions, or top-k, leave boundaries far from rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

from protocol.sampling_params import SamplingParams
from serving.engine.request import Req
from serving.engine.scheduler_core import SchedulerCore
from tests.helpers import make_core

_ALONE: dict[str, SchedulerCore] = {}


def alone(model, ids: list[int], params: SamplingParams, req_out: list | None = None) -> list[int]:
    """The request's tokens alone in the batch (no prefix cache, a pool it cannot outgrow)."""
    core = _ALONE.get(model.name)
    if core is None:
        core = _ALONE[model.name] = make_core(model, disable_prefix_cache=True, max_total_tokens=4096)
    req = core.add_request("x", ids, params)
    if req_out is not None:
        req_out.append(req)
    return [t for ev in core.run_to_completion() for t in ev.new_token_ids]


def drive(
    core: SchedulerCore,
    plan: dict[int, list[tuple[str, list[int], SamplingParams]]],
    aborts: dict[int, list[str]] | None = None,
) -> tuple[dict[str, list[int]], dict[str, Req]]:
    """Add `plan[step]` and abort `aborts[step]` before each step; invariants after every step."""
    outs: dict[str, list[int]] = {}
    reqs: dict[str, Req] = {}
    step = 0
    while step <= max(plan) or core.has_work:
        for rid, ids, params in plan.get(step, []):
            reqs[rid] = core.add_request(rid, ids, params)
            outs[rid] = []
        for rid in (aborts or {}).get(step, []):
            core.abort(rid)
        for ev in core.step():
            outs[ev.rid].extend(ev.new_token_ids)
        core.check_kv_invariants()
        step += 1
        assert step < 20_000, "the engine did not go idle"
    return outs, reqs


def assert_counters(core: SchedulerCore, reqs: dict[str, Req]) -> None:
    rs = [r.times.retractions for r in reqs.values()]
    assert core.retractions == sum(len(x) for x in rs)
    assert core.retracted_tokens == sum(x.computed for r in rs for x in r)
    for r in reqs.values():  # one waiting interval per entry into the queue (an abort in the queue ends its last)
        assert len(r.times.waits) in (r.num_retractions, r.num_retractions + 1), r.rid
        assert r.times.waited_ns() == sum(b - a for a, b in r.times.waits)


def greedy_long(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_retracted_requests_resume_with_their_own_tokens(tiny, cache):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(8, 24))] for _ in range(6)]
    params = [
        greedy_long(60)
        if i % 2
        else SamplingParams(max_new_tokens=60, temperature=0.9, top_k=40, seed=i, ignore_eos=True)
        for i in range(6)
    ]
    core = make_core(tiny, max_total_tokens=200, disable_prefix_cache=not cache)  # 6 x ~76 slots do not fit
    outs, reqs = drive(core, {0: [(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]})
    assert core.retractions > 0
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == alone(tiny, p, params[i]), f"r{i}"
    assert_counters(core, reqs)
    if cache:  # pinned in the cache, a retracted request mostly resumes as a hit
        assert core.batches.recomputed_tokens < core.retracted_tokens
    else:  # without it, everything it had is computed again
        assert core.batches.recomputed_tokens == core.retracted_tokens
    assert core.pool.is_idle() and core.flush_cache() and core.pool.is_empty()


def test_reserve_never_retracts_and_serves_the_same_tokens(tiny):
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 1000) for _ in range(12)] for _ in range(5)]
    plan = {0: [(f"r{i}", p, greedy_long(50)) for i, p in enumerate(prompts)]}
    core = make_core(tiny, max_total_tokens=200, admission="reserve")
    outs, reqs = drive(core, plan)
    assert core.retractions == 0 and core.policy.ratio == 1.0
    assert max(len(r.times.waits) for r in reqs.values()) == 1
    estimate = make_core(tiny, max_total_tokens=200)
    outs_e, _ = drive(estimate, plan)
    assert estimate.retractions > 0 and outs_e == outs


@pytest.fixture(scope="module")
def mix(tiny):
    """200 requests arriving about one a step (greedy and seeded sampling, some sharing an opening, 15% aborted
    at a random point), and each one's tokens alone."""
    rng = random.Random(31)
    shared = [rng.randrange(3, 1000) for _ in range(16)]
    plan: dict[int, list] = {}
    aborts: dict[int, list[str]] = {}
    refs: dict[str, list[int]] = {}
    for i in range(200):
        ids = (shared if rng.random() < 0.3 else []) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))]
        p = SamplingParams(
            max_new_tokens=rng.randint(1, 48),
            temperature=rng.choice([0.0, 0.0, 0.8]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([20, 50]),
            seed=i,
            ignore_eos=rng.random() < 0.7,
        )
        at = i + rng.randint(0, 2)
        plan.setdefault(at, []).append((f"r{i}", ids, p))
        if rng.random() < 0.15:
            aborts.setdefault(at + rng.randint(0, 30), []).append(f"r{i}")
        refs[f"r{i}"] = alone(tiny, ids, p)
    return plan, aborts, refs


@pytest.mark.parametrize("cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_200_random_requests_with_aborts_under_retraction(tiny, mix, cache):
    plan, aborts, refs = mix
    core = make_core(
        tiny,
        max_total_tokens=192,
        max_running_requests=16,
        max_prefill_tokens=48,
        new_token_ratio_decay_steps=40,
        disable_prefix_cache=not cache,
    )  # a quick decay: many cycles
    outs, reqs = drive(core, plan, aborts)
    assert core.retractions >= 20, core.retractions
    aborted = {rid for rid, r in reqs.items() if r.finish_reason.value == "abort"}
    assert aborted and len(reqs) == 200
    for rid, ref in refs.items():
        assert outs[rid] == (ref[: len(outs[rid])] if rid in aborted else ref), rid
    assert_counters(core, reqs)
    assert core.pool.is_idle() and not core.reqs
    assert core.flush_cache() and core.pool.is_empty()


def test_a_resumed_request_makes_the_same_draws(tiny):
    """Full-vocabulary sampling, recomputed without the cache: the generator is where it would be alone."""
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(5)]
    prompts = [[20 + i] * 12 for i in range(5)]
    core = make_core(tiny, max_total_tokens=150, disable_prefix_cache=True)
    _, reqs = drive(core, {0: [(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]})
    assert core.retractions > 0
    for i, p in enumerate(prompts):
        ref: list = []
        alone(tiny, p, params[i], ref)
        assert torch.equal(reqs[f"r{i}"].generator.get_state(), ref[0].generator.get_state())


def test_a_retracted_request_aborted_in_the_queue_unpins_its_kv(tiny):
    core = make_core(tiny, max_total_tokens=120)
    for i in range(4):
        core.add_request(f"r{i}", [5 + i] * 10, greedy_long(80))
    retracted = None
    for _ in range(400):
        core.step()
        core.check_kv_invariants()
        retracted = next((r for r in core.waiting if r.num_retractions), None)
        if retracted is not None:
            break
    assert retracted is not None and retracted.pinned is not None
    assert core.abort(retracted.rid) is not None and retracted.pinned is None
    core.check_kv_invariants()
    assert retracted.times.waits[-1][1] == retracted.times.finished
    core.run_to_completion()
    assert core.pool.is_idle()


def test_a_retraction_admits_no_one_in_the_same_step_and_raises_the_ratio(tiny):
    core = make_core(tiny, max_total_tokens=120)
    for i in range(4):
        core.add_request(f"r{i}", [7 + i] * 10, greedy_long(80))
    core.policy.ratio = core.policy.min_ratio  # as after a long calm: admission is at its most optimistic
    for _ in range(400):
        running = len(core.running)
        core.step()
        if core.last_step.num_retracted:
            break
    assert core.last_step.num_retracted and len(core.running) == running - core.last_step.num_retracted
    assert core.policy.ratio >= core.policy.init_ratio
    core.run_to_completion()


def test_max_queue_time_spares_retracted_requests(tiny):
    core = make_core(tiny, max_total_tokens=120)
    core.add_request("a", [9] * 10, greedy_long(80))
    req = core.add_request("b", [11] * 10, greedy_long(80))
    while not req.num_retractions and core.has_work:
        core.step()
    assert req.times.scheduled is not None  # the Scheduler's --max-queue-time only expires never-run requests
