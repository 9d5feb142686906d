"""The prefill time budget through a real tiny-random server: a long prompt arriving beside a decoding stream is
prefilled in chunks within the step caps, both answers are whole, the budget shows in /metrics; bad values of
the flags stop the start with a clear message."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server_util import ServerProc, Stream, scrape, value, wait_until

CAP, FLOOR, MAX_MS = 64, 8, 400.0
LONG = "word " * 300


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProc(
        "--step-time-factor",
        "2",
        "--max-step-ms",
        str(MAX_MS),
        "--max-step-tokens",
        str(CAP),
        "--min-prefill-chunk",
        str(FLOOR),
        tmpdir=tmp_path_factory.mktemp("step_budget"),
        step_floor_ms=25,  # the stream is still decoding when the long prompt arrives
    )
    try:
        yield s
    finally:
        s.stop()


def test_a_long_prompt_beside_a_decoding_stream_is_chunked_within_the_caps(srv):
    stream = Stream(srv, "Count slowly:", {"max_new_tokens": 60, "ignore_eos": True, "temperature": 0})
    wait_until(lambda: len(stream.tokens()) >= 1, 30, "the stream's first token")
    r = srv.post("/v1/completions", {"prompt": LONG, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 2 * CAP and usage["completion_tokens"] == 4 and r.json()["choices"][0]["text"]
    stream.join(60)
    assert stream.status == 200 and len(stream.tokens()) == 60
    trace = httpx.get(srv.url + "/debug/timeline", params={"seconds": 60}, timeout=30).json()
    steps = [e["args"] for e in trace["traceEvents"] if e.get("name") == "step"]
    mixed = [s for s in steps if s["decode"] and s["prefill_tokens"]]
    assert sum(s["prefill_tokens"] for s in mixed) >= usage["prompt_tokens"] - CAP  # beside the stream's decodes
    assert len(mixed) >= 2 and all(s["decode"] + s["prefill_tokens"] <= CAP for s in mixed), mixed
    srv.barrier()
    text = scrape(srv)
    assert 0 <= value(text, "sightline_step_time_budget_seconds") <= MAX_MS / 1e3
    assert 0 <= value(text, "sightline_step_prefill_budget_tokens") <= CAP


@pytest.mark.parametrize(
    "flag, bad, message",
    [
        ("--step-time-factor", "0.5", "--step-time-factor must be 0 (off) or between 1 and 1000"),
        ("--step-time-factor", "nan", "--step-time-factor must be 0 (off) or between 1 and 1000"),
        ("--max-step-ms", "-5", "--max-step-ms must be between 0 (no limit) and 3600000"),
    ],
)
def test_bad_values_stop_the_start(flag, bad, message):
    out = subprocess.run(
        [sys.executable, "-m", "serving", "serve", "--model", "tiny-random", flag, bad],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and f"error: {message}" in out.stderr, out.stderr[-2000:]
