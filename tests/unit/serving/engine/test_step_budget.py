"""The prefill time budget (serving.engine.step_budget): step records in, chunk sizes out, deterministic — the
cost model is fed made-up step records, never timed."""

from __future__ import annotations

import pytest

from serving.engine.events import StepStats
from serving.engine.step_budget import (
    HALF_LIFE,
    MIN_STEPS,
    OUTLIER,
    TOKEN_FLOOR,
    StepBudget,
    StepCost,
    nonnegative_fit,
)
from tests.helpers import make_core

FIXED, PER_DECODE, PER_PREFILL = 0.010, 0.0005, 0.002  # the made-up machine: 10 ms + 0.5 ms a row + 2 ms a token


def cost(d: int, p: int) -> float:
    return FIXED + PER_DECODE * d + PER_PREFILL * p


def record(d: int, p: int, seconds: float | None = None) -> StepStats:
    """A step of `d` decodes and one `p`-token prefill chunk (if any), as the engine records it."""
    tokens = (1,) * d + ((p,) if p else ())
    return StepStats(
        batch_size=len(tokens),
        num_decode=d,
        num_prefill_tokens=p,
        tokens=tokens,
        step_seconds=cost(d, p) if seconds is None else seconds,
    )


TEACH = ((8, 0), (8, 32), (16, 0), (16, 64), (4, 100), (0, 512)) + ((16, 0),) * 8  # mostly pure decodes of 16


def taught(budget: StepBudget, steps=TEACH) -> StepBudget:
    for d, p in steps:
        budget.observe(record(d, p))
    return budget


def test_the_fit_finds_the_machines_costs():
    c = StepCost()
    for d, p in [(8, 0), (8, 32), (16, 0), (16, 64), (4, 100), (0, 512), (32, 0), (32, 16)]:
        c.observe(d, p, cost(d, p))
    assert c.coef == pytest.approx((FIXED, PER_DECODE, PER_PREFILL), rel=1e-3)
    assert c.decode_seconds(20) == pytest.approx(FIXED + 20 * PER_DECODE, rel=1e-3)
    assert c.per_prefill == pytest.approx(PER_PREFILL, rel=1e-3)


def test_no_term_goes_negative_when_decodes_and_prefill_are_collinear():
    c = StepCost()
    for d in range(4, 16):  # the token cap alone: d + p = 128 every step; the truth has a negative intercept
        c.observe(d, 128 - d, -0.040 + 0.003 * (128 - d) + 0.001 * d)
    assert c.coef is not None and min(c.coef) >= 0
    cheap = StepCost()
    for d in range(4, 16):  # the same cap, steps that a plain fit would read as prompt tokens free
        cheap.observe(d, 128 - d, 0.0065 * d)
    assert cheap.coef is not None and cheap.coef[2] >= TOKEN_FLOOR * cheap.coef[1] > 0
    xx = [[1.0, 0.0], [0.0, 1.0]]
    assert nonnegative_fit(xx, [2.0, -3.0]) == (2.0, 0.0)  # the unconstrained -3 is clamped to 0


def test_decode_rows_may_cost_more_than_prompt_tokens():
    """A decode row carries an lm_head row and attends over its whole context: the fit finds it dearer than a
    prompt token when the steps say so, and the pure-decode step it predicts is the one the steps took."""
    c = StepCost()
    truth = (0.004, 0.002, 0.001)  # 4 ms + 2 ms a decode row + 1 ms a prompt token
    for d, p in [(4, 0), (4, 90), (8, 80), (16, 0), (12, 60), (0, 512), (16, 40), (10, 0)]:
        c.observe(d, p, truth[0] + truth[1] * d + truth[2] * p)
    assert c.coef == pytest.approx(truth, rel=1e-3)
    assert c.decode_seconds(16) == pytest.approx(0.036, rel=1e-3)


def test_old_steps_fade():
    c = StepCost()
    for d, p in [(8, 0), (8, 64), (16, 0), (16, 32)] * 10:
        c.observe(d, p, 2 * cost(d, p))  # a slower machine (another process took the CPU) ...
    for d, p in [(8, 0), (8, 64), (16, 0), (16, 32)] * int(4 * HALF_LIFE):
        c.observe(d, p, cost(d, p))  # ... then the usual one, for many half-lives
    assert c.per_prefill == pytest.approx(PER_PREFILL, rel=0.01)


def test_a_preempted_step_counts_as_at_most_outlier_times_its_prediction():
    b = taught(StepBudget(factor=3.0, max_seconds=0.0))
    clipped = taught(StepBudget(factor=3.0, max_seconds=0.0))
    assert b.prefill_tokens(16) == clipped.prefill_tokens(16) == 18  # as the engine asks, every step: fitted
    b.observe(record(16, 64, seconds=100 * cost(16, 64)))  # another process had the CPU for a while
    clipped.observe(record(16, 64, seconds=OUTLIER * cost(16, 64)))
    assert b.cost.coef == clipped.cost.coef


def test_the_prefill_fills_the_budget_left_by_the_decodes():
    b = taught(StepBudget(factor=3.0, max_seconds=0.0))
    decode = FIXED + 16 * PER_DECODE  # 18 ms: the budget is 54 ms, the decodes leave 36 ms, 18 tokens
    assert b.prefill_tokens(16) == 18 and b.last_seconds == pytest.approx(3 * decode, rel=1e-3)
    assert b.prefill_tokens(64) == 42  # more decodes: a longer pure-decode step (42 ms), a larger budget


def test_early_in_a_burst_the_budget_is_that_of_the_batch_the_queue_heads_to():
    b = taught(StepBudget(factor=3.0, max_seconds=0.0))
    # 4 decode, 12 wait: the typical step is a 16-row decode (18 ms, budget 54 ms); 4 rows take 12 ms: 21 tokens
    assert b.prefill_tokens(4, heading=16) == 21 and b.last_seconds == pytest.approx(0.054, rel=1e-3)
    assert b.prefill_tokens(4) in (11, 12)  # its own 4 decodes as the typical step: (36 - 12) ms ÷ 2 ms, floored
    assert b.prefill_tokens(16, heading=4) == 18  # never below the step's own decodes


def test_max_step_ms_caps_the_budget():
    b = taught(StepBudget(factor=3.0, max_seconds=0.030))
    assert b.prefill_tokens(16) == 6 and b.last_seconds == 0.030  # (30 - 18) ms ÷ 2 ms
    assert taught(StepBudget(factor=0.0, max_seconds=0.030)).prefill_tokens(16) == 6  # the cap alone
    assert taught(StepBudget(factor=3.0, max_seconds=0.010)).prefill_tokens(16) == 0  # the decodes take it all


def test_off_untaught_and_probe():
    off = StepBudget(factor=0.0, max_seconds=0.0)
    assert off.prefill_tokens(16) is None and not off.probe
    off.observe(record(16, 32))
    assert off.cost.steps == 0  # nothing learned while off
    b = StepBudget(factor=3.0, max_seconds=0.0)
    assert b.probe  # no pure-decode step seen: the next step with decodes runs them alone
    b.observe(record(16, 0))
    assert not b.probe
    assert b.prefill_tokens(16) == 0  # fewer than MIN_STEPS steps: the floor runs
    for _ in range(MIN_STEPS):
        b.observe(record(16, 64))
    assert b.prefill_tokens(16) is not None and b.prefill_tokens(16) > 0
    for _ in range(int(HALF_LIFE) + 1):  # a long admission burst: mixed steps only
        b.observe(record(16, 64))
    assert b.probe


def test_the_batch_builder_applies_caps_floor_and_probe(tiny):
    core = make_core(tiny, max_prefill_tokens=512, max_step_tokens=256, min_prefill_chunk=8, step_time_factor=3.0)
    bb = core.batches
    taught(bb.timing)
    assert bb.prefill_budget(0) == 512  # nothing decodes: no gap to protect
    assert bb.prefill_budget(16) == 18 and core.stats()["prefill_budget_tokens"] == 18
    assert bb.prefill_budget(4, heading=16) == 21  # the batch the queue heads to sets the typical step
    assert core.stats()["step_budget_seconds"] == pytest.approx(0.054, rel=1e-3)
    bb.timing.factor = 1.2  # a budget the decodes nearly fill: the floor keeps prompts moving
    assert bb.prefill_budget(16) == 8
    bb.timing.factor = 100.0  # a budget beyond the token cap: the cap holds
    assert bb.prefill_budget(16) == 256 - 16
    bb.timing.cost.decode_weight = 0.0  # no pure-decode step for a long while: this one runs the decodes alone
    assert bb.prefill_budget(16) == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"step_time_factor": 0.5}, "--step-time-factor must be 0 (off) or between 1 and 1000"),
        ({"step_time_factor": float("nan")}, "--step-time-factor"),
        ({"max_step_ms": -1.0}, "--max-step-ms must be between 0"),
    ],
)
def test_bad_values_are_refused(tiny, flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_core(tiny, **flags)
