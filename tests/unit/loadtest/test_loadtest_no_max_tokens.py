"""The no-max-tokens workload: requests as the openai client sends them by default, with no max_tokens,
through the plan's JSON (what Locust workers read) and beside a workload that sets it."""

from __future__ import annotations

import random

import pytest

from loadtest.config import Config, ConfigError, Plan, Workload
from loadtest.workloads import build_request


def test_no_max_tokens_workload_sends_no_max_tokens():
    cfg = Config.load()
    sc = cfg.scenario("no-max-tokens")
    assert set(sc.mix) == {"no-max-tokens", "chat"} and sc.arrival == "closed"
    ws = [cfg.workloads["no-max-tokens"], cfg.workloads["chat"]]
    assert ws[0].max_tokens is None and ws[1].max_tokens == (128, 128)
    plan = Plan.from_json(Plan("http://x", "m", sc, ws, "r.jsonl").to_json())
    bodies = [build_request(w, plan, random.Random(1))[1] for w in plan.workloads]
    assert "max_tokens" not in bodies[0] and bodies[0]["stream"] is True and bodies[0]["messages"]
    assert bodies[1]["max_tokens"] == 128


def test_a_context_long_prompt_needs_a_max_tokens():
    w = Workload.from_dict("x", {"endpoint": "completions", "prompt_tokens": "context", "max_tokens": "none"})
    with pytest.raises(ConfigError, match="needs a max_tokens"):
        w.resolve(8192)
