"""The goodput search's level choice on simulated servers, and where its thresholds come from
(dashboards/slo.yaml, overridden by the config), without a server."""

from __future__ import annotations

import pytest

from loadtest.config import Config, ConfigError, Search, slo_spec_goodput
from loadtest.gate import evaluate
from loadtest.search import Step, bounds, next_level
from loadtest.stats import summarize


def simulate(search: Search, capacity: float, closed: bool = False) -> list[Step]:
    """Run the search against a server that meets the SLO exactly up to `capacity`."""
    steps: list[Step] = []
    while (level := next_level(search, closed, steps)) is not None:
        ok = level <= capacity
        steps.append(Step(len(steps), level, "", 10, 10 if ok else 0, 0, 1.0 if ok else 0.0, 0.0, 0.0, ok, None, None))
    return steps


def test_ramp_then_bisection_brackets_the_capacity_within_the_precision():
    s = Search(objective=0.99, start=1, factor=2, max_level=1000, max_steps=12, precision=0.05)
    steps = simulate(s, capacity=10.3)
    assert [st.level for st in steps[:5]] == [1, 2, 4, 8, 16]  # ramp until the first failure
    lo, hi = bounds(steps)
    assert lo <= 10.3 < hi and hi - lo <= 0.05 * hi and len(steps) <= 12
    assert len(simulate(Search(objective=0.99, start=1, max_steps=4), capacity=100)) == 4  # bounded


def test_closed_loop_levels_stay_whole_users():
    steps = simulate(Search(objective=0.99, start=1, factor=3, max_level=64, max_steps=10), capacity=7, closed=True)
    assert all(st.level == int(st.level) for st in steps)
    assert bounds(steps) == (7, 8)


def test_no_level_passes_and_max_level_caps_the_ramp():
    s = Search(objective=0.99, start=4, factor=2, max_level=16, max_steps=6)
    none = simulate(s, capacity=0)
    assert bounds(none)[0] == 0 and all(not st.passed for st in none)
    capped = simulate(s, capacity=100)
    assert [st.level for st in capped] == [4, 8, 16] and bounds(capped) == (16, None)


def test_goodput_defaults_come_from_slo_yaml_and_the_config_overrides_them(tmp_path):
    thresholds, objective = slo_spec_goodput()
    assert thresholds == {"ttft_ms": 1000.0, "tpot_ms": 100.0} and objective == 0.99
    shipped = Config.load()
    assert shipped.goodput == thresholds and shipped.objective == objective
    assert shipped.scenario("goodput_search").search.objective == objective
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "workloads: {w: {endpoint: chat}}\n"
        "scenarios:\n  s: {mix: {w: 1}, arrival: poisson, search: {start: 0.5},"
        " goodput: {tpot_ms: 40, objective: 0.9}}\n"
        "goodput: {ttft_ms: 300}\n"
    )
    sc = Config.load(cfg).scenario("s")
    assert sc.goodput == {"ttft_ms": 300.0, "tpot_ms": 40.0} and sc.search.objective == 0.9
    assert Config.load(cfg, slo_spec=tmp_path / "absent.yaml").scenario("s").goodput == {
        "ttft_ms": 300.0,
        "tpot_ms": 40.0,
    }
    assert slo_spec_goodput(tmp_path / "absent.yaml") == ({}, None)


def test_search_refusals():
    with pytest.raises(ConfigError):
        Search.from_dict({"factor": 1}, 0.99, "poisson")
    with pytest.raises(ConfigError):
        Search.from_dict({"start": 1.5}, 0.99, "closed")
    with pytest.raises(ConfigError):
        Search.from_dict({"steps": 3}, 0.99, "poisson")
    with pytest.raises(ConfigError):
        Config.load().scenario("default", goodput={"ttfb_ms": 1})


def test_knee_gate_fails_without_a_knee():
    s = summarize([], {}, 1.0)
    assert evaluate(s, {"goodput_knee_min": 2}, knee=4)[0].passed
    assert not evaluate(s, {"goodput_knee_min": 2}, knee=1)[0].passed
    assert not evaluate(s, {"goodput_knee_min": 0}, knee=None)[0].passed
