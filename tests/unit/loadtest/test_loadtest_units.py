"""The load test's arithmetic on numbers worked out by hand: metric definitions, goodput, the gate,
PromQL-style histogram quantiles, and the config's refusals."""

from __future__ import annotations

import pytest

from loadtest.config import Config, ConfigError, Shape, Workload
from loadtest.gate import check_keys, evaluate, parse_slo_args
from loadtest.reconcile import Scrape, histogram_quantile, reconcile
from loadtest.records import RequestRecord
from loadtest.stats import meets, summarize


def rec(
    ttft: float,
    chunks: list[float],
    e2e: float,
    tokens: int,
    error: str | None = None,
    stage: int = 0,
    start: float = 100.0,
) -> RequestRecord:
    return RequestRecord(
        "w", "chat", stage, 1.0 + stage, start, e2e, 200, "error" if error else "length", error, ttft, chunks, 5, tokens
    )


def test_definitions_tpot_itl_and_chunks_carrying_several_tokens():
    r = rec(0.5, [0.5, 0.6, 0.9], e2e=1.0, tokens=6)  # 3 chunks, 6 tokens
    assert r.itl == pytest.approx([0.1, 0.3])  # per chunk gap
    assert r.tpot == pytest.approx((1.0 - 0.5) / 5)  # (e2e − TTFT)/(n − 1), n from usage
    assert rec(0.5, [0.5], e2e=0.5, tokens=1).tpot is None


def test_summary_percentiles_goodput_and_stages():
    recs = [
        rec(0.1 * i, [0.1 * i, 0.1 * i + 0.05], e2e=0.1 * i + 0.5, tokens=2, stage=i // 5, start=100 + i)
        for i in range(1, 11)
    ]
    recs.append(rec(None, [], e2e=0.2, tokens=0, error="http 400 context_length_exceeded", start=100))
    s = summarize(recs, {"ttft_ms": 550}, stage_seconds=5)
    assert (s.requests, s.failures) == (11, 1)
    assert s.error_rate == pytest.approx(1 / 11)
    assert s.latency.ttft_ms.count == 10 and s.latency.ttft_ms.p50 == pytest.approx(550)
    assert s.latency.itl_ms.p99 == pytest.approx(50)
    assert s.goodput_requests == 5  # TTFT ≤ 550 ms: i = 1..5; the failure never counts
    assert s.duration_s == pytest.approx(110 + 1.5 - 100)
    assert s.failure_reasons == {"http 400 context_length_exceeded": 1}
    assert [st.requests for st in s.stages] == [5, 5, 1] and s.output_tokens == 20
    assert not meets(recs[-1], {})


def test_gate_passes_fails_and_refuses_unknown_keys():
    s = summarize([rec(0.2, [0.2, 0.3], 0.4, 2)], {}, 1.0)
    checks = {
        c.name: c for c in evaluate(s, {"ttft_p99_ms": 250, "itl_max_ms": 50, "goodput_min": 0.1, "error_rate": 0})
    }
    assert checks["ttft_p99_ms"].passed and not checks["itl_max_ms"].passed
    assert checks["goodput_min"].op == ">=" and checks["error_rate"].passed
    assert not evaluate(summarize([], {}, 1.0), {"ttft_p99_ms": 1e9})[0].passed  # nothing to judge: fail
    with pytest.raises(ConfigError):
        check_keys({"ttft_p98_ms": 1})
    with pytest.raises(ConfigError):
        parse_slo_args(["ttft_p99_ms"])
    assert parse_slo_args(["ttft_p99_ms=1.5"]) == {"ttft_p99_ms": 1.5}


def test_histogram_quantile_like_promql():
    cum = {0.1: 2.0, 0.2: 6.0, 0.4: 10.0, float("inf"): 10.0}
    assert histogram_quantile(0.5, cum) == pytest.approx(0.175)  # rank 5 in (0.1, 0.2]: 0.1 + 0.1 * 3/4
    assert histogram_quantile(0.1, cum) == pytest.approx(0.05)  # first bucket starts at 0
    assert histogram_quantile(0.99, {0.1: 1.0, float("inf"): 2.0}) == 0.1  # in +Inf: the last finite bound
    assert histogram_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_scrape_deltas_by_label():
    text = (
        "# TYPE sightline_requests_total counter\n"
        'sightline_requests_total{model_name="m",finish_reason="stop",status="200"} {}\n'
        'sightline_requests_total{model_name="m",finish_reason="error",status="400"} {}\n'
    )
    before = Scrape.parse(text.replace("{}", "1", 1).replace("{}", "0"))
    after = Scrape.parse(text.replace("{}", "4", 1).replace("{}", "2"))
    assert after.minus(before).by("sightline_requests_total", "finish_reason", model_name="m") == {
        "stop": 3.0,
        "error": 2.0,
    }


def test_config_shapes_and_refusals(tmp_path):
    assert Shape.from_dict({"kind": "steps", "start": 1, "step": 2, "stop": 7, "stage_seconds": 5}).levels == (
        1,
        3,
        5,
        7,
    )
    cfg = Config.load()
    assert cfg.scenario("default").arrival == "closed" and cfg.scenario("poisson").arrival == "poisson"
    long = cfg.workloads["long"].resolve(2048)
    assert long.prompt_tokens == (2048 - 32 - 8,) * 2
    with pytest.raises(ConfigError):
        Workload.from_dict("x", {"endpoint": "chat", "prompt_tokens": 10})
    with pytest.raises(ConfigError):
        cfg.scenario("default", mix={"nope": 1})
    with pytest.raises(ConfigError):
        cfg.scenario("default", shape=Shape((1.5,), 10))  # closed loop: whole users
    with pytest.raises(ConfigError):
        Shape.from_dict({"kind": "ramp"})


def exposition(counts: dict[tuple[str, str], int], gen: int, ttft_le: dict[str, int]) -> Scrape:
    """A /metrics text with the four families reconciliation reads (model "m", 10 prompt tokens)."""
    m = 'model_name="m"'
    lines = [
        f"# TYPE sightline_{n} {kind}"
        for n, kind in (
            ("requests_total", "counter"),
            ("prompt_tokens_total", "counter"),
            ("generation_tokens_total", "counter"),
            ("time_to_first_token_seconds", "histogram"),
        )
    ]
    lines += [f'sightline_requests_total{{{m},finish_reason="{f}",status="{st}"}} {n}' for (f, st), n in counts.items()]
    lines += [f"sightline_prompt_tokens_total{{{m}}} 10", f"sightline_generation_tokens_total{{{m}}} {gen}"]
    lines += [f'sightline_time_to_first_token_seconds_bucket{{{m},le="{le}"}} {n}' for le, n in ttft_le.items()]
    return Scrape.parse("\n".join(lines) + "\n")


def test_reconcile_counts_tokens_and_the_ttft_order():
    before = exposition({("length", "200"): 0, ("abort", "503"): 0}, 0, {"0.1": 0, "0.2": 0, "+Inf": 0})
    ok = rec(0.15, [0.15, 0.2], 0.3, 2)
    ok.prompt_tokens = 10
    cut = rec(None, [], 0.3, 0)
    cut.error, cut.finish_reason, cut.completion_tokens = "error event: server_unavailable", "abort", None
    # the server saw the first token at 0.12 s (≤ the client's 0.15 s) and generated 5 tokens in all
    after = exposition({("length", "200"): 1, ("abort", "503"): 1}, 5, {"0.1": 0, "0.2": 1, "+Inf": 1})
    r = reconcile([ok, cut], before, after, "m", {})
    assert r.counts_match and r.server_ttft_le_client and not r.tokens_comparable and r.ok
    assert reconcile([ok], before, after, "m", {}).ok is False  # one request the client never saw
    late = exposition({("length", "200"): 1, ("abort", "503"): 1}, 5, {"0.1": 0, "0.2": 0, "+Inf": 1})
    assert not reconcile([ok, cut], before, late, "m", {}).server_ttft_le_client  # server slower than client
    assert not reconcile([ok, cut], None, after, "m", {}).available


def test_a_request_cut_before_any_response_may_be_missing_from_the_servers_aborts():
    ok = rec(0.15, [0.15, 0.2], 0.3, 2)
    ok.prompt_tokens = 10
    cut = rec(None, [], 0.3, 0, error="stopped by locust before the end")
    cut.finish_reason, cut.status, cut.completion_tokens = "abort", 499, None
    before = exposition({("length", "200"): 0, ("abort", "499"): 0}, 0, {"0.2": 0, "+Inf": 0})
    seen = exposition({("length", "200"): 1, ("abort", "499"): 1}, 2, {"0.2": 1, "+Inf": 1})
    never = exposition({("length", "200"): 1}, 2, {"0.2": 1, "+Inf": 1})
    assert reconcile([ok, cut], before, seen, "m", {}).counts_match
    assert not reconcile([ok, cut], before, never, "m", {}).counts_match  # it had a response: the server knew it
    cut.unanswered = True  # cut while it was still being connected or sent
    for after in (seen, never):
        r = reconcile([ok, cut], before, after, "m", {})
        assert r.counts_match and r.client_unanswered == 1 and "cut before any response" in r.note
    two = exposition({("length", "200"): 1, ("abort", "499"): 2}, 2, {"0.2": 1, "+Inf": 1})
    assert not reconcile([ok, cut], before, two, "m", {}).counts_match  # more aborts than the client sent
    short = exposition({("abort", "499"): 1}, 2, {"0.2": 1, "+Inf": 1})
    assert not reconcile([ok, cut], before, short, "m", {}).counts_match  # it excuses aborts only
