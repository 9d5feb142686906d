"""Prompt-lookup speculation through one real SmolLM2 server (`--speculative ngram`): a copying answer is the
same text with speculation as without (a request opting out is never speculated), and what the request says
it proposed and accepted agrees with /debug/requests, the request's span numbers and the engine's metrics."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e.test_debug_ui import Rows, chromium, headless
from tests.server_util import ServerProc, scrape, sse_events, value

CHAT = "/v1/chat/completions"
TEXT = "the red fox jumps over the old stone wall and runs into the green forest"
MESSAGES = [{"role": "user", "content": f"Repeat this sentence three times: {TEXT}. {TEXT}."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProc("--speculative", "ngram", model="smollm2-135m", tmpdir=tmp_path_factory.mktemp("spec-server"))
    yield s
    s.stop()


def _chat(srv: ServerProc, **extra) -> tuple[str, dict, str]:
    """A streamed greedy chat completion of exactly 40 tokens: its text, its last chunk's usage with the
    server's breakdown (`sightline`) in it, and its rid."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    with httpx.stream("POST", srv.url + CHAT, json=body, timeout=120) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
        rid = r.headers["x-request-id"]
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    (last,) = [e for e in events[:-1] if e.get("usage")]
    return text, {**last["usage"], "sightline": last["sightline"]}, rid


@pytest.fixture(scope="module")
def runs(srv):
    """The same copying request speculated and opted out."""
    return {"on": _chat(srv), "off": _chat(srv, speculative=False)}


def test_a_copying_answer_is_the_same_with_speculation_and_its_drafts_land(runs):
    (text_on, usage_on, _), (text_off, usage_off, _) = runs["on"], runs["off"]
    assert TEXT.split()[2] in text_on and text_on == text_off
    assert usage_on["completion_tokens"] == usage_off["completion_tokens"] == 40
    spec = usage_on["sightline"]["speculative"]
    assert 0 < spec["accepted"] <= spec["proposed"] and spec["rejected"] == spec["proposed"] - spec["accepted"]
    # every step gave it one token of the target's own plus the drafts it accepted (it ended on its length)
    assert spec["accepted"] + spec["steps"] == usage_on["completion_tokens"]
    assert spec["steps"] < usage_on["completion_tokens"]  # fewer steps than tokens: what speculation is for


def test_a_request_that_opts_out_is_never_speculated(runs):
    assert "speculative" not in runs["off"][1]["sightline"]


def test_every_generation_route_takes_the_opt_out(srv, runs):
    prompt = f"Repeat: {TEXT}. {TEXT}."
    for speculative in (True, False):
        sp = {"max_new_tokens": 12, "temperature": 0, "speculative": speculative}
        body = srv.post("/generate", {"text": prompt, "sampling_params": sp}).json()
        assert len(body["output_ids"]) == 12 and ("speculative" in body["meta_info"]["sightline"]) is speculative
    msg = {"model": "smollm2-135m", "max_tokens": 8, "messages": MESSAGES, "speculative": False, "ignore_eos": True}
    body = srv.post("/v1/messages", msg).json()
    assert body["usage"]["output_tokens"] == 8 and "speculative" not in body["sightline"]
    resp = {"input": TEXT, "max_output_tokens": 8, "speculative": False, "temperature": 0, "ignore_eos": True}
    body = srv.post("/v1/responses", resp).json()
    assert body["usage"]["output_tokens"] == 8 and "speculative" not in body["sightline"]


def test_debug_requests_and_metrics_agree_with_the_requests(srv, runs):
    srv.barrier()
    entries = httpx.get(srv.url + "/debug/requests", timeout=10).json()["requests"]
    speculated = [e["speculative"] for e in entries if "speculative" in e]
    assert runs["on"][1]["sightline"]["speculative"] in speculated and len(entries) == 6
    text = scrape(srv)
    proposed = value(text, "sightline_speculative_proposed_tokens_total", method="ngram")
    accepted = value(text, "sightline_speculative_accepted_tokens_total", method="ngram")
    assert proposed == sum(s["proposed"] for s in speculated) and accepted == sum(s["accepted"] for s in speculated)
    assert 0 < accepted <= proposed
    assert value(text, "sightline_speculative_acceptance_rate_count", method="ngram") == len(speculated)
    rate = value(text, "sightline_speculative_acceptance_rate_sum", method="ngram")
    assert rate == pytest.approx(sum(s["accepted"] / s["proposed"] for s in speculated))
    steps = value(text, "sightline_speculative_step_tokens_count", method="ngram")
    assert 0 < steps <= sum(s["steps"] for s in speculated)
    assert value(text, "sightline_engine_step_phase_seconds_count", phase="verify") > 0


def test_the_decode_span_and_the_inspector_show_each_verify_step_on_the_token_timeline(srv, runs, tmp_path):
    _, usage, rid = runs["on"]
    spec = usage["sightline"]["speculative"]
    srv.barrier()  # the Scheduler's spans (they come with its stats) are in
    spans = httpx.get(f"{srv.url}/debug/requests/{rid}", timeout=10).json()["spans"]
    (decode,) = [s for s in spans if s["name"] == "decode"]
    verifies = [e for e in decode["events"] if e["name"] == "speculative_verify"]
    runs_seen = [
        tuple(e["attributes"][f"sightline.speculative.{k}"] for k in ("token_index", "accepted", "proposed"))
        for e in verifies
    ]
    # every verify step, in token order, its counts adding up to the request's; each at its first token's time
    assert sum(k for _, k, _ in runs_seen) == spec["accepted"] and sum(p for *_, p in runs_seen) == spec["proposed"]
    assert [i for i, *_ in runs_seen] == sorted({i for i, *_ in runs_seen}) and runs_seen[0][0] >= 1
    assert all(decode["start_ns"] <= e["time_ns"] <= decode["end_ns"] for e in verifies)
    assert any(k for _, k, _ in runs_seen) and all(0 <= k <= p for _, k, p in runs_seen)

    dom = headless(chromium(), tmp_path, f"{srv.url}/debug/ui#rid={rid}", "--dump-dom")
    parsed = Rows()
    parsed.feed(dom)
    (row,) = [r for r in parsed.rows if r.get("data-source") == "spec"]
    assert row["data-lane"] == "scheduler" and int(row["data-steps"]) == len(verifies)
    assert (int(row["data-accepted"]), int(row["data-proposed"])) == (spec["accepted"], spec["proposed"])
    assert row["data-runs"].split() == [f"{i}:{k}/{p}" for i, k, p in runs_seen]


def test_flags_out_of_range_fail_at_startup_with_a_clear_message():
    for flags, message in (
        (["--speculative", "eagle"], "--speculative must be one of off, ngram"),
        (["--speculative", "ngram", "--speculative-num-tokens", "17"], "--speculative-num-tokens must be in [1, 16]"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "serving", "serve", "--model", "tiny-random", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode != 0 and message in p.stderr, p.stderr[-500:]
