"""Why each waiting request was not admitted, on the real engine (tiny-random): every reason is forced by a
configuration, and for every request the time per reason sums exactly to its queue time."""

from __future__ import annotations

from protocol.sampling_params import SamplingParams
from serving.engine.request import Req
from serving.engine.scheduler_core import SchedulerCore
from serving.engine.wait_reasons import PAUSED, WAIT_REASONS, assign
from telemetry.clock import now_ns
from tests.helpers import make_core


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def run(core: SchedulerCore, reqs: list[Req]) -> None:
    core.run_to_completion()
    for r in reqs:
        assert set(r.times.wait.ns) <= set(WAIT_REASONS), r.times.wait.ns
        assert sum(r.times.wait.ns.values()) == r.times.waited_ns(), r.rid  # exactly the queue time
        assert r.times.wait.reason is None and r.times.wait.since is None


def add(core: SchedulerCore, n: int, prompt_len: int = 8, new: int = 4) -> list[Req]:
    return [
        core.add_request(f"r{i}", [3 + (i * 7 + j) % 900 for j in range(prompt_len)], params(new)) for i in range(n)
    ]


def test_admitted_at_once_waited_for_the_next_step(tiny):
    core = make_core(tiny)
    (r,) = add(core, 1)
    run(core, [r])
    assert list(r.times.wait.ns) == ["next_step"]


def test_running_limit(tiny):
    core = make_core(tiny, max_running_requests=1)
    r0, r1, r2 = add(core, 3)
    run(core, [r0, r1, r2])
    assert "running_limit" in r1.times.wait.ns and "running_limit" in r2.times.wait.ns
    assert "queue_order" not in r2.times.wait.ns  # a global reason holds back everyone, not just the head
    assert r1.times.wait.changes[0][1] == "running_limit"


def test_step_budget(tiny):
    core = make_core(tiny, max_prefill_tokens=16, min_prefill_chunk=16, max_step_tokens=16)
    r0, r1 = add(core, 2, prompt_len=40)  # r0 takes three steps' budget to prefill
    run(core, [r0, r1])
    assert r1.times.wait.ns.get("step_budget", 0) > 0


def test_kv_capacity_then_queue_order(tiny):
    # each needs 170 of 200 slots; the token caps alone: the time budget's first step with decodes runs them
    # alone (its anchor), which would put a step_budget wait between the two
    core = make_core(tiny, max_total_tokens=200, admission="reserve", step_time_factor=0)
    reqs = add(core, 3, prompt_len=20, new=150)
    run(core, reqs)
    assert reqs[1].times.wait.ns.get("kv_capacity", 0) > 0
    assert reqs[2].times.wait.ns.get("queue_order", 0) > 0  # behind a head that waits for KV
    assert reqs[2].times.wait.ns.get("kv_capacity", 0) > 0  # then the head itself
    assert [c[1] for c in reqs[2].times.wait.changes][:2] == ["queue_order", "kv_capacity"]


def test_retracted(tiny):
    core = make_core(tiny, max_total_tokens=200)  # six requests outgrow the estimate
    reqs = add(core, 6, prompt_len=16, new=60)
    run(core, reqs)
    assert core.retractions > 0
    retracted = [r for r in reqs if r.num_retractions]
    assert all(r.times.wait.ns.get("retracted", 0) > 0 for r in retracted)


def test_paused(tiny):
    core = make_core(tiny)
    reqs = add(core, 2)
    assign(core.waiting, PAUSED, now_ns())  # what the Scheduler does when a pause takes effect
    run(core, reqs)
    assert all(list(r.times.wait.ns) == ["paused"] for r in reqs)


def test_aborted_in_the_queue(tiny):
    core = make_core(tiny, max_running_requests=1)
    r0, r1 = add(core, 2, new=20)
    core.step()
    core.abort("r1")
    run(core, [r0, r1])
    assert r1.times.wait.ns.get("running_limit", 0) > 0
