"""`python -m loadtest --replay` end to end: a real dump, replayed against a real tiny-random server.

One server with `--dump-requests` records 20 requests sent here in bursts over ~2 s (streamed
and plain completions, chat, /generate streamed and plain, /v1/responses streamed and plain);
the dump is copied and replayed against the same server at `--speed 4` (~10 s, most of it
Locust starting).  The dump has no
content, so every prompt is synthetic: the server's usage must show exactly the recorded
prompt tokens, and (max_tokens exact) the recorded completion tokens.  Sends must follow the
recorded offsets ÷ 4; the report must pair every recorded request with its replay; the plot
must exist.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from telemetry.request_record import read_records
from tests.server_util import ServerProc, wait_until

REPO = Path(__file__).resolve().parents[2]
N = 20
SPEED = 4.0


def body(i: int) -> tuple[str, dict]:
    kind = i % 5
    if kind == 0:
        return "/v1/completions", {
            "model": "tiny-random",
            "prompt": f"Tell me about {i} " * (1 + i % 4),
            "max_tokens": 3 + i % 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    if kind == 1:
        return "/v1/chat/completions", {
            "model": "tiny-random",
            "max_tokens": 5,
            "stream": True,
            "messages": [{"role": "user", "content": f"hello {i} " * (1 + i)}],
        }
    if kind == 2:
        return "/v1/completions", {
            "model": "tiny-random",
            "prompt": list(range(100, 110 + i)),
            "max_tokens": 4,
            "temperature": 0,
        }
    if kind == 3:
        return "/generate", {"text": f"generate {i}", "sampling_params": {"max_new_tokens": 6}, "stream": True}
    if i % 10 == 9:
        return "/v1/responses", {
            "model": "tiny-random",
            "input": f"respond {i} " * (1 + i % 3),
            "max_output_tokens": 4,
            "stream": i == 19,
            "store": False,
        }
    return "/generate", {"text": f"plain {i}", "sampling_params": {"max_new_tokens": 3}}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    srv = ServerProc("--dump-requests", str(tmp / "live-dump"), tmpdir=tmp)
    try:

        def send(i: int) -> None:
            path, b = body(i)
            httpx.post(srv.url + path, json=b, timeout=60).raise_for_status()

        threads = []
        for i in range(N):  # bursts of five, 0.5 s apart, 50 ms between the requests of a burst
            time.sleep(0.5 if i and i % 5 == 0 else 0.05)  # clock: the arrival offsets recorded, replayed ÷ SPEED
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
        for t in threads:
            t.join()
        wait_until(lambda: len(list(read_records(tmp / "live-dump"))) >= N, 10, "the dump to hold every request")
        shutil.copytree(tmp / "live-dump", tmp / "dump")  # the replay's own requests are recorded too
        yield srv, tmp
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def replay(recorded):
    srv, tmp = recorded
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "--replay",
            str(tmp / "dump"),
            "--url",
            srv.url,
            "--speed",
            str(SPEED),
            "--out",
            str(tmp / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, proc, json.loads((tmp / "out" / "replay.json").read_text())


def test_every_record_replayed_on_schedule(replay):
    tmp, proc, doc = replay
    records = sorted(read_records(tmp / "dump"), key=lambda r: r.arrival)
    assert len(records) == N and doc["records"] == doc["replayed"] == doc["sent"] == N and doc["skipped"] == 0
    rows = doc["requests"]
    assert [r["rid"] for r in rows] == [r.rid for r in records]
    for rec, row in zip(records, rows):
        assert row["sent"] and row["route"] == rec.route and row["stream"] == rec.stream
        assert row["due_s"] == pytest.approx((rec.arrival - records[0].arrival) / SPEED, abs=1e-3)
        assert row["sent_s"] - row["due_s"] == pytest.approx(0.0, abs=0.25), row  # a loaded 2-core machine
    assert doc["schedule"]["last_due_s"] == pytest.approx((records[-1].arrival - records[0].arrival) / SPEED, abs=1e-3)
    assert len((tmp / "out" / "records.jsonl").read_text().splitlines()) == N
    assert "replay of" in proc.stdout and "ttft_ms" in proc.stdout


def test_synthetic_prompts_and_output_lengths_match_the_recording(replay):
    _, _, doc = replay
    assert doc["run"]["synthetic_prompts"] == N and doc["run"]["prompt_tokens_exact"]
    assert doc["prompt_tokens_match"] == N and doc["completion_tokens_match"] == N
    assert doc["outcomes"]["recorded"] == doc["outcomes"]["replayed"] == {"length": N}


def test_report_pairs_recorded_and_replayed_latencies(replay):
    tmp, _, doc = replay
    for row in doc["requests"]:
        rec, rep = row["recorded"], row["replayed"]
        assert rec["ttft_ms"] > 0 and rec["e2e_ms"] >= rec["ttft_ms"]
        assert rep["server"]["ttft_ms"] > 0 and rep["server"]["e2e_ms"] >= rep["server"]["ttft_ms"]
        assert rep["client"]["e2e_ms"] >= rep["server"]["e2e_ms"] * 0.9
        assert (rep["client"]["ttft_ms"] is not None) == row["stream"]  # no client TTFT without a stream
        assert row["request_id"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert doc["latency"][key]["recorded"]["count"] == doc["latency"][key]["replayed_server"]["count"] > 0
    meta = json.loads(Image.open(tmp / "out" / doc["plot"]).text["sightline:replay"])
    assert meta["sent"] == N and meta["e2e_ms:recorded"] == meta["e2e_ms:server"] == N
