"""Decode gaps on the real engine (tiny-random): a long prefill beside decoding streams is the cause of their
gap, and it is named; a retraction is the cause of the retracted request's gap."""

from __future__ import annotations

from protocol.sampling_params import SamplingParams
from serving.engine import decode_gaps
from serving.engine.decode_gaps import DecodeGaps, GapRules
from serving.engine.scheduler_core import SchedulerCore
from tests.helpers import make_core


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def step(core: SchedulerCore, gaps: DecodeGaps) -> None:
    events = core.step()
    gaps.stepped(core.last_step, events)


def test_a_long_prefill_beside_streams_is_their_gap_and_names_the_culprit(tiny, monkeypatch):
    monkeypatch.setattr(decode_gaps, "MAX_GAPS", 10_000)  # a loaded CPU's noise gaps must not crowd it out
    core = make_core(tiny, max_prefill_tokens=4096, max_step_tokens=4096, step_time_factor=0)  # the prompt in one chunk
    n = min(1000, core.context_len - 64)
    gaps = DecodeGaps(GapRules(factor=3.0, floor_s=0.0))
    streams = [core.add_request(f"s{i}", [5 + i, 6, 7, 8], params(80)) for i in range(3)]
    for _ in range(30):  # the streams decode; the typical step is theirs
        step(core, gaps)
    before = dict(gaps.counts)
    long = core.add_request("long", [3 + j % 900 for j in range(n)], params(2))
    step(core, gaps)
    assert core.last_step.prefill_rids == ("long",)
    found = [g for s in streams for g in s.times.gaps if g.cause == "prefill"]
    assert len(found) == 3, [s.times.gaps for s in streams]
    assert all(g.culprits == ("long",) and g.prefill_tokens == n and g.batch_size == 4 for g in found)
    assert gaps.counts["prefill"] - before["prefill"] == 3  # exactly the gaps it caused
    core.run_to_completion()
    assert not [g for g in long.times.gaps if g.cause == "prefill"]


def test_a_retracted_requests_gap_is_the_retraction(tiny, monkeypatch):
    monkeypatch.setattr(decode_gaps, "MAX_GAPS", 10_000)  # every gap kept: the counter must equal them
    core = make_core(tiny, max_total_tokens=200)
    gaps = DecodeGaps(GapRules(factor=3.0, floor_s=0.0))
    reqs = [core.add_request(f"r{i}", [5 + i] * 16, params(60)) for i in range(6)]
    while core.has_work:
        step(core, gaps)
    assert core.retractions
    found = 0
    for r in reqs:
        for g in r.times.gaps:  # a gap with a retraction in it is the retraction's, and only such a gap is
            assert (g.cause == "retraction") == any(g.start < x.at <= g.end for x in r.times.retractions), g
            found += g.cause == "retraction"
    assert found and gaps.counts["retraction"] == found


def test_a_fast_engine_has_no_gaps_under_the_floor(tiny):
    core = make_core(tiny)
    gaps = DecodeGaps(GapRules(floor_s=10.0))
    core.add_request("a", [5, 6, 7], params(30))
    while core.has_work:
        step(core, gaps)
    assert sum(gaps.counts.values()) == 0 and [g.count for g in gaps.snapshot()] == [0] * len(gaps.counts)
