"""The load test's prefix-cache parts, without a server: the shared-prefix workload, cached_tokens
from the usage chunk, the reconciliation of cached tokens with the server's hits, the gate key,
and the benchmarks' prompts that share nothing."""

from __future__ import annotations

import json
import random
import types

import pytest

from bench.common import make_prompts
from loadtest.config import Config, ConfigError, Plan, Workload
from loadtest.gate import check_keys, evaluate
from loadtest.reconcile import Scrape, reconcile
from loadtest.records import RequestRecord, load_records
from loadtest.report import reconciliation_lines
from loadtest.sse import StreamReader
from loadtest.stats import summarize
from loadtest.workloads import build_request, shared_prefix_ids, system_prompt
from serving.model_files import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")[0]  # SmolLM2's tokenizer


def plan_for(w: Workload) -> Plan:
    cfg = Config.load()
    return Plan.from_json(Plan("http://x", "m", cfg.scenario("default"), [w], "r.jsonl").to_json())


def test_shared_prefix_workload_and_scenario_ship():
    cfg = Config.load()
    w = cfg.workloads["shared-prefix"]
    assert (w.endpoint, w.system_prompt_tokens, w.max_tokens, w.temperature) == ("chat", 1000, (32, 32), 0)
    sc = cfg.scenario("shared_prefix")
    assert sc.mix == {"shared-prefix": 1.0} and sc.arrival == "closed"
    for bad in (-1, 1.5, "many", True):
        with pytest.raises(ConfigError):
            Workload.from_dict("x", {"endpoint": "chat", "system_prompt_tokens": bad})


def test_chat_requests_share_one_system_prompt_of_about_n_tokens(tok):
    w = Config.load().workloads["shared-prefix"]
    plan = plan_for(w)
    assert plan.workloads[0].system_prompt_tokens == 1000  # survives the plan's JSON
    bodies = [build_request(plan.workloads[0], plan, random.Random(seed))[1] for seed in range(4)]
    systems = {json.dumps(b["messages"][0]) for b in bodies}
    assert len(systems) == 1 and bodies[0]["messages"][0]["role"] == "system"
    assert len({b["messages"][1]["content"] for b in bodies}) == 4  # the user turns vary
    assert 990 <= len(tok(system_prompt(1000))["input_ids"]) <= 1010
    for b in bodies:
        assert 12 <= len(tok(b["messages"][1]["content"])["input_ids"]) <= 28  # ~20-token user turns
        assert b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
    assert system_prompt(1000) == system_prompt(1000) != system_prompt(999)
    # the prefix draws nothing from the request's generator: the user turns are those of the same
    # workload without it
    plain = plan_for(Workload("p", "chat", (32, 32), prompts=w.prompts, temperature=0))
    assert (
        build_request(plain.workloads[0], plain, random.Random(7))[1]["messages"]
        == build_request(plan.workloads[0], plan, random.Random(7))[1]["messages"][1:]
    )


def test_completions_prefix_is_exact_and_counted_in_context():
    w = Workload.from_dict("c", {"endpoint": "completions", "prompt_tokens": [4, 8], "system_prompt_tokens": 50})
    plan = plan_for(w)
    prompts = [build_request(plan.workloads[0], plan, random.Random(s))[1]["prompt"] for s in range(3)]
    prefix = list(shared_prefix_ids(50, plan.token_id_range))
    assert all(p[:50] == prefix and 54 <= len(p) <= 58 for p in prompts)
    assert len({tuple(p[50:]) for p in prompts}) == 3
    long = Workload.from_dict(
        "l", {"endpoint": "completions", "prompt_tokens": "context", "max_tokens": 32, "system_prompt_tokens": 100}
    )
    assert long.resolve(2048).prompt_tokens == (2048 - 32 - 8 - 100,) * 2


def usage_event(details) -> bytes:
    usage = {"prompt_tokens": 1030, "completion_tokens": 2, "total_tokens": 1032}
    if details is not ...:
        usage["prompt_tokens_details"] = details
    return f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()


@pytest.mark.parametrize(
    "details, cached", [({"cached_tokens": 1008}, 1008), ({"cached_tokens": 0}, 0), (None, None), (..., None)]
)
def test_usage_chunk_gives_cached_tokens(details, cached, tmp_path):
    rec = RequestRecord("w", "chat", 0, 1.0, 0.0, 0.0, 200)
    r = StreamReader(rec, 0.0)
    text = 'data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}\n\n'
    r.feed(text.encode(), 0.1)
    r.feed(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n', 0.2)
    r.feed(usage_event(details) + b"data: [DONE]\n\n", 0.3)
    out = r.finish(0.3)
    assert out.ok and out.prompt_tokens == 1030 and out.cached_tokens == cached
    (tmp_path / "r.jsonl").write_text(out.to_json() + "\n")
    assert load_records(tmp_path / "r.jsonl")[0].cached_tokens == cached


def exposition(hits: int | None, queries: int, gen: int = 4) -> Scrape:
    m = 'model_name="m"'
    lines = [
        "# TYPE sightline_requests_total counter",
        f'sightline_requests_total{{{m},finish_reason="length",status="200"}} {2 if gen else 0}',
        "# TYPE sightline_prompt_tokens_total counter",
        f"sightline_prompt_tokens_total{{{m}}} {gen and 2060}",
        "# TYPE sightline_generation_tokens_total counter",
        f"sightline_generation_tokens_total{{{m}}} {gen}",
        "# TYPE sightline_time_to_first_token_seconds histogram",
        f'sightline_time_to_first_token_seconds_bucket{{{m},le="1.0"}} {2 if gen else 0}',
        f'sightline_time_to_first_token_seconds_bucket{{{m},le="+Inf"}} {2 if gen else 0}',
    ]
    if hits is not None:
        lines += [
            "# TYPE sightline_prefix_cache_hits_tokens_total counter",
            f"sightline_prefix_cache_hits_tokens_total{{{m}}} {hits}",
            "# TYPE sightline_prefix_cache_queries_tokens_total counter",
            f"sightline_prefix_cache_queries_tokens_total{{{m}}} {queries}",
        ]
    return Scrape.parse("\n".join(lines) + "\n")


def ok_rec(cached: int | None) -> RequestRecord:
    return RequestRecord("w", "chat", 0, 1.0, 100.0, 0.5, 200, "length", None, 0.2, [0.2, 0.3], 1030, 2, cached)


def test_cached_tokens_reconcile_exactly_with_the_hits_counter():
    # before the run: 1000 hits of 1030 (the warm-up); the run adds 2016 of 2060
    before, after = exposition(1000, 1030, gen=0), exposition(3016, 3090)
    r = reconcile([ok_rec(1008), ok_rec(1008)], before, after, "m", {})
    assert r.prefix_cache_available and r.cached_tokens_match and r.ok, r
    assert (r.client_cached_tokens, r.server_prefix_hits_tokens, r.server_prefix_queries_tokens) == (2016, 2016, 2060)
    assert r.prefix_hit_ratio == pytest.approx(2016 / 2060)
    text = "\n".join(reconciliation_lines(r))
    assert "cached tokens (usage | prefix-cache hits): 2016 | 2016  match" in text and "97.9%" in text
    off = reconcile([ok_rec(1008), ok_rec(1007)], before, after, "m", {})  # one token unaccounted for
    assert not off.cached_tokens_match and not off.ok and "DIFFER" in "\n".join(reconciliation_lines(off))
    assert not reconcile([ok_rec(1008), ok_rec(None)], before, after, "m", {}).ok  # a usage without the field


def test_a_server_without_a_prefix_cache_skips_the_check():
    r = reconcile([ok_rec(None), ok_rec(None)], exposition(None, 0, gen=0), exposition(None, 0), "m", {})
    assert r.ok and not r.prefix_cache_available and r.prefix_hit_ratio is None
    assert "sightline_prefix_cache_hits_tokens_total" in r.note
    assert not any("hit ratio" in line for line in reconciliation_lines(r))
    disabled = reconcile([ok_rec(0), ok_rec(0)], exposition(0, 0, gen=0), exposition(0, 2060), "m", {})
    assert disabled.ok and disabled.prefix_hit_ratio == 0.0  # --disable-prefix-cache: counted, never hit


def test_gate_prefix_hit_ratio_min():
    check_keys({"prefix_hit_ratio_min": 0.9})
    s = summarize([ok_rec(1008)], {}, 1.0)
    [c] = evaluate(s, {"prefix_hit_ratio_min": 0.9}, prefix_hit_ratio=0.95)
    assert c.passed and c.op == ">="
    assert not evaluate(s, {"prefix_hit_ratio_min": 0.9}, prefix_hit_ratio=0.5)[0].passed
    assert not evaluate(s, {"prefix_hit_ratio_min": 0.9})[0].passed  # not known: nothing to judge


def test_benchmark_prompts_share_no_first_token(tok):
    m = types.SimpleNamespace(tokenizer=tok)
    prompts = make_prompts(m, 80, 64)
    assert all(len(p) == 64 for p in prompts) and len({p[0] for p in prompts}) == 80
    later = make_prompts(m, 10, 64, start=80)
    assert not {p[0] for p in later} & {p[0] for p in prompts}
    assert make_prompts(m, 5, 64, start=3) == prompts[3:8]
    assert all(tok(tok.decode(p))["input_ids"] == p for p in prompts[:20])  # bench.peers sends them as text
