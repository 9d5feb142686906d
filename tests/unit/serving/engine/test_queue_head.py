"""The queue head the stuck-queue check reads: the oldest waiting request's age, whether the next request to
admit would fit, and the admission counter — on the in-process engine, with the admission-stop seam as the
fault (tokens trickle out of the running request, nobody is admitted)."""

from __future__ import annotations

from serving.engine.queue_head import queue_head
from serving.engine.seams import STOP_ADMISSION_ENV
from telemetry.clock import now_ns
from tests.helpers import encode, greedy, make_core

STOP = 4242


def test_a_head_held_back_by_the_running_limit_does_not_fit(tiny):
    core = make_core(tiny, max_running_requests=1)
    assert queue_head(core, now_ns()) == {"queue_head_age_seconds": 0.0, "queue_head_fits": False}
    core.add_request("a", encode(tiny, "First"), greedy(8, ignore_eos=True))
    core.step()
    core.add_request("b", encode(tiny, "Second"), greedy(2, ignore_eos=True))
    core.step()
    head = queue_head(core, now_ns() + 2 * 10**9)  # two seconds later
    assert head["queue_head_age_seconds"] >= 2 and head["queue_head_fits"] is False  # saturated, not stuck
    assert core.stats()["admissions_total"] == 1


def test_with_admission_stopped_the_head_fits_ages_and_nothing_is_admitted_while_tokens_flow(tiny, monkeypatch):
    monkeypatch.setenv(STOP_ADMISSION_ENV, str(STOP))
    core = make_core(tiny)
    core.add_request("stuck", encode(tiny, "Trickle"), greedy(12, ignore_eos=True, seed=STOP))
    core.step()
    core.add_request("waiting", encode(tiny, "Let me in"), greedy(2, ignore_eos=True))
    tokens = sum(len(ev.new_token_ids) for _ in range(5) for ev in core.step())
    assert tokens == 5 and core.num_waiting == 1 and core.stats()["admissions_total"] == 1
    head = queue_head(core, now_ns())
    assert head["queue_head_fits"] is True and head["queue_head_age_seconds"] > 0
    assert queue_head(core, now_ns(), paused=True)["queue_head_fits"] is False  # paused on purpose: not stuck
    core.run_to_completion()  # the marked request ends: admission resumes
    assert core.stats()["admissions_total"] == 2 and queue_head(core, now_ns())["queue_head_age_seconds"] == 0
